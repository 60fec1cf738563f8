"""RoPE: the YaRN cos/sin table against transformers, and the ``rope`` op against float64 math."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

import mlagraph  # noqa: F401  (registers the ops)
from mlagraph.ops._define import op_body
from mlagraph.ops.rope import rope_cos_sin_cache, rope_inv_freq, yarn_softmax_mscale
from tests.helpers import arg_error, assert_value_error

rope = torch.ops.mlagraph.rope

V3_YARN = {
    "rope_type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
YARN_VARIANTS = {
    "v3": V3_YARN,
    "v2_lite_old_format": {  # old rope_scaling spelling, DeepSeek-V2-Lite values
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "mscale_only": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 0.9},
    "attention_factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "attention_factor": 1.3,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "factor_none": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0, "mscale": 1.0},
    "no_truncate": dict(V3_YARN, truncate=False),
}
MAX_POS_EMB = 163840
THETA = 10000.0


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _hf_config(scaling: dict, rope_dim: int = 64) -> DeepseekV3Config:
    return DeepseekV3Config(
        rope_parameters=dict(scaling, rope_theta=THETA),
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=MAX_POS_EMB,
        num_hidden_layers=1,
    )


# ---------------------------------------------------------------------------------------------
# cos/sin table


@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_matches_transformers_bitwise(variant):
    scaling = YARN_VARIANTS[variant]
    config = _hf_config(dict(scaling))
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    inv_freq, attention = rope_inv_freq(64, THETA, dict(scaling), max_position_embeddings=MAX_POS_EMB)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert attention == hf_attention

    # cos/sin as DeepseekV3RotaryEmbedding computes them, for positions including long ones.
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 50000, 163839])
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(config)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    table = rope_cos_sin_cache(64, MAX_POS_EMB, THETA, dict(scaling), max_position_embeddings=MAX_POS_EMB)
    assert table.shape == (MAX_POS_EMB, 64) and table.dtype == torch.float32
    assert torch.equal(table[positions, :32], hf_cos[0, :, :32])
    assert torch.equal(table[positions, 32:], hf_sin[0, :, :32])


def test_default_rope_matches_transformers_and_formula():
    config = _hf_config({"rope_type": "default"}, rope_dim=16)
    hf_cos, hf_sin = hf_ds.DeepseekV3RotaryEmbedding(config)(torch.zeros(1), torch.arange(50)[None])
    for scaling in (None, {"rope_type": "default", "rope_theta": THETA}):
        table = rope_cos_sin_cache(16, 50, THETA, scaling)
        assert torch.equal(table[:, :8], hf_cos[0, :, :8]) and torch.equal(table[:, 8:], hf_sin[0, :, :8])
    # Independent float64 formula: angle(p, i) = p * theta^(-2i/d).
    expected = torch.tensor(
        [[math.cos(p * THETA ** (-2 * i / 16)) for i in range(8)] + [math.sin(p * THETA ** (-2 * i / 16)) for i in range(8)] for p in range(50)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(table.double(), expected, atol=2e-5, rtol=0)


def test_yarn_table_is_mscaled_and_differs_from_default():
    table = rope_cos_sin_cache(64, 8, THETA, V3_YARN)
    # Position 0: cos = mscale (ratio 1 for mscale == mscale_all_dim), sin = 0.
    torch.testing.assert_close(table[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    # YaRN interpolates the low frequencies: the last pair turns 40x slower than default RoPE.
    default = rope_cos_sin_cache(64, 8, THETA)
    inv, _ = rope_inv_freq(64, THETA, V3_YARN)
    inv_default, _ = rope_inv_freq(64, THETA)
    assert inv[0] == inv_default[0]
    torch.testing.assert_close(inv[-1].double(), inv_default[-1].double() / 40, rtol=1e-6, atol=0)
    assert not torch.equal(table, default)


def test_cos_sin_cache_device():
    table = rope_cos_sin_cache(8, 4, THETA, V3_YARN, device="meta")
    assert table.device.type == "meta" and table.shape == (4, 8)


def test_softmax_mscale():
    assert 192**-0.5 * yarn_softmax_mscale(V3_YARN) == pytest.approx(0.135234, abs=1e-6)
    for variant in ("v3", "v2_lite_old_format"):
        scaling = YARN_VARIANTS[variant]
        expected = hf_ds.yarn_apply_mscale(_hf_config(dict(scaling)).rope_parameters, 192**-0.5)
        assert 192**-0.5 * yarn_softmax_mscale(scaling) == pytest.approx(expected, rel=1e-14)
    factor_none = YARN_VARIANTS["factor_none"]
    assert yarn_softmax_mscale(factor_none, max_position_embeddings=MAX_POS_EMB) == pytest.approx(
        (0.1 * math.log(40) + 1) ** 2
    )
    assert yarn_softmax_mscale(None) == 1.0
    assert yarn_softmax_mscale({"rope_type": "default", "mscale_all_dim": 1.0, "factor": 40}) == 1.0
    assert yarn_softmax_mscale(YARN_VARIANTS["mscale_only"]) == 1.0  # no mscale_all_dim


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(scaling={"rope_type": "linear", "factor": 2.0}), "scaling['rope_type']"),
        (dict(scaling={"type": "llama3", "factor": 2.0}), "scaling['rope_type']"),
        (dict(rope_dim=7), "rope_dim"),
        (dict(rope_dim=0), "rope_dim"),
        (dict(max_position=0), "max_position"),
        (dict(base=-1.0), "base"),
        (dict(scaling=dict(V3_YARN, rope_theta=50000.0)), "base"),
        (dict(scaling=dict(V3_YARN, partial_rotary_factor=0.5)), "scaling['partial_rotary_factor']"),
        (dict(scaling=YARN_VARIANTS["factor_none"]), "max_position_embeddings"),
        (dict(scaling={"rope_type": "yarn", "factor": 4.0}), "scaling"),
    ],
)
def test_cos_sin_cache_bad_input(kwargs, arg):
    args = dict(rope_dim=8, max_position=16, base=THETA, scaling=None) | kwargs
    with pytest.raises(ValueError, match=arg_error(arg)):
        rope_cos_sin_cache(**args)


def test_softmax_mscale_bad_input():
    with pytest.raises(ValueError, match=arg_error("scaling['rope_type']")):
        yarn_softmax_mscale({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=arg_error("max_position_embeddings")):
        yarn_softmax_mscale(YARN_VARIANTS["factor_none"])


# ---------------------------------------------------------------------------------------------
# the op

T, H, R, P = 5, 3, 8, 64


def _inputs(dtype=torch.float32, pos_dtype=torch.int64, t=T, h=H, r=R):
    q_pe = torch.randn(t, h, r, dtype=dtype)
    k_pe = torch.randn(t, 1, r, dtype=dtype)
    positions = torch.randperm(P)[:t].to(pos_dtype)
    table = rope_cos_sin_cache(r, P, THETA, V3_YARN | {"mscale": 1.3})  # mscale != 1 shows up in values
    return q_pe, k_pe, positions, table


def _rope_float64(x, positions, table, interleaved):
    """x [T, N, R] -> rotated float64, one token and one pair at a time."""
    x = x.double()
    table = table.double()
    out = torch.empty_like(x)
    t_, n_, r_ = x.shape
    half = r_ // 2
    for t in range(t_):
        p = int(positions[t])
        for n in range(n_):
            for i in range(half):
                c, s = float(table[p, i]), float(table[p, half + i])
                a, b = (2 * i, 2 * i + 1) if interleaved else (i, half + i)
                out[t, n, a] = x[t, n, a] * c - x[t, n, b] * s
                out[t, n, b] = x[t, n, b] * c + x[t, n, a] * s
    return out


TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=2e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_matches_float64(dtype, interleaved):
    q_pe, k_pe, positions, table = _inputs(dtype)
    q, k = rope(q_pe, k_pe, positions, table, interleaved)
    assert q.dtype == dtype and k.dtype == dtype and q.shape == q_pe.shape and k.shape == k_pe.shape
    torch.testing.assert_close(q.double(), _rope_float64(q_pe, positions, table, interleaved), **TOL[dtype])
    torch.testing.assert_close(k.double(), _rope_float64(k_pe, positions, table, interleaved), **TOL[dtype])


def _hf_cos_sin(table, positions):
    half = table.shape[1] // 2
    cos, sin = table[positions, :half], table[positions, half:]
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, T, R] like HF


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_dot_products_match_transformers(interleaved):
    q_pe, k_pe, positions, table = _inputs()
    q, k = rope(q_pe, k_pe, positions, table, interleaved)
    cos, sin = _hf_cos_sin(table, positions)
    hf_apply = hf_ds.apply_rotary_pos_emb_interleave if interleaved else hf_ds.apply_rotary_pos_emb
    # transformers wants [batch, heads, seq, dim].
    hf_q, hf_k = hf_apply(q_pe.transpose(0, 1)[None], k_pe.transpose(0, 1)[None], cos, sin)
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)
    torch.testing.assert_close(
        torch.einsum("thr,sr->hts", q, k[:, 0]), torch.einsum("thr,sr->hts", hf_q, hf_k[:, 0]), atol=1e-5, rtol=1e-5
    )
    if interleaved:  # ours stays interleaved, theirs is [evens | odds]
        q, k = torch.cat([q[..., 0::2], q[..., 1::2]], -1), torch.cat([k[..., 0::2], k[..., 1::2]], -1)
    torch.testing.assert_close(q, hf_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, hf_k, atol=1e-6, rtol=1e-6)


def test_rope_non_contiguous_inputs():
    q_pe, k_pe, positions, table = _inputs()
    q_big = torch.randn(T, H, 16 + R)
    q_big[..., 16:] = q_pe
    k_big = torch.randn(T, 2, R * 2)
    k_big[:, 1:, R:] = k_pe
    pos_big = torch.stack([positions, positions], -1)
    table_big = torch.cat([table, table], -1)
    args = (q_big[..., 16:], k_big[:, 1:, R:], pos_big[:, 1], table_big[:, R:])
    assert not any(a.is_contiguous() for a in args)
    for interleaved in (True, False):
        q, k = rope(*args, interleaved)
        q_ref, k_ref = rope(q_pe, k_pe, positions, table, interleaved)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_opcheck(dtype, interleaved):
    q_pe, k_pe, positions, table = _inputs(dtype, pos_dtype=torch.int32 if interleaved else torch.int64)
    torch.library.opcheck(rope, (q_pe, k_pe, positions, table, interleaved))


def test_rope_compile_dynamic():
    def fn(q_pe, k_pe, positions, table):
        q, k = rope(q_pe, k_pe, positions, table, True)
        return q * 2, k + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (3, 6):
        args = _inputs(torch.bfloat16, t=t)
        for got, want in zip(compiled(*args), fn(*args)):
            assert torch.equal(got, want)


def _bad_rope_cases():
    q_pe, k_pe, positions, table = _inputs()
    meta = torch.device("meta")
    return [
        ("q_pe", (q_pe[0], k_pe, positions, table)),
        ("q_pe", (q_pe.to(torch.int32), k_pe, positions, table)),
        ("q_pe", (q_pe[..., :7], k_pe[..., :7], positions, table[:, :7])),
        ("k_pe", (q_pe, k_pe.expand(T, H, R), positions, table)),
        ("k_pe", (q_pe, k_pe[:4], positions, table)),
        ("k_pe", (q_pe, k_pe.half(), positions, table)),
        ("k_pe", (q_pe, k_pe.to(meta), positions, table)),
        ("positions", (q_pe, k_pe, positions[:4], table)),
        ("positions", (q_pe, k_pe, positions.float(), table)),
        ("positions", (q_pe, k_pe, positions.to(meta), table)),
        ("cos_sin_cache", (q_pe, k_pe, positions, table[:, :6])),
        ("cos_sin_cache", (q_pe, k_pe, positions, table.bfloat16())),
        ("cos_sin_cache", (q_pe, k_pe, positions, table[0])),
        ("cos_sin_cache", (q_pe, k_pe, positions, table.to(meta))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_rope_cases())))
def test_rope_bad_input(case):
    arg, args = _bad_rope_cases()[case]
    assert_value_error(rope, (*args, True), arg_error(arg))


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor value on the host (a sync; no CUDA graph capture)."""

    SYNCS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.nonzero.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            raise AssertionError(f"host sync in a reference op: {func}")
        return func(*args, **(kwargs or {}))


def test_rope_reference_has_no_host_sync():
    args = _inputs()
    body = op_body("mlagraph::rope")  # the op's Python body, so the mode sees its aten ops
    with NoHostSync():
        for interleaved in (True, False):
            body(*args, interleaved)
