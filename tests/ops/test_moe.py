"""mlagraph.ops.moe.route and mlagraph::moe against transformers' DeepSeek routers and experts,
a float64 loop, and the all-experts oracle (moe_all_experts); fp8 experts against their
dequantized weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Config, DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

import mlagraph  # noqa: F401  (registers the ops)
import mlagraph.ops.moe as moe_module
from mlagraph.ops._define import op_body
from mlagraph.ops.fp8 import dequantize_blockwise, quantize_blockwise
from mlagraph.ops.moe import moe_all_experts, route
from tests import helpers
from tests.helpers import capture_cuda_graph

moe_op = torch.ops.mlagraph.moe

HIDDEN, INTER, E, T = 16, 8, 8, 6

# (name, scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
ROUTINGS = [
    ("v2_lite", "softmax", "greedy", 1, 1, 3, False, 1.0),
    ("v2", "softmax", "group_limited_greedy", 4, 2, 3, False, 16.0),
    ("v2_one_group", "softmax", "group_limited_greedy", 1, 1, 2, False, 1.0),
    ("v3", "sigmoid", "noaux_tc", 4, 2, 3, True, 2.5),
    ("v3_no_norm", "sigmoid", "noaux_tc", 4, 2, 3, False, 2.5),
    ("v3_one_group", "sigmoid", "noaux_tc", 1, 1, 2, True, 2.5),
]
ROUTING_IDS = [r[0] for r in ROUTINGS]


def hf_moe(scoring, method, n_group, topk_group, top_k, norm, scale, seed=0):
    """transformers' MoE block for this routing, with random weights (and bias for V3)."""
    common = dict(hidden_size=HIDDEN, num_attention_heads=4, moe_intermediate_size=INTER, n_routed_experts=E,
                  num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, n_shared_experts=1,
                  routed_scaling_factor=scale, norm_topk_prob=norm)
    torch.manual_seed(seed)
    if scoring == "softmax":  # the V2 router: never normalizes (norm is applied in the tests)
        m = DeepseekV2Moe(DeepseekV2Config(topk_method=method, **common))
    else:
        m = DeepseekV3MoE(DeepseekV3Config(**common))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        if scoring == "sigmoid":
            m.gate.e_score_correction_bias.normal_(0, 0.3)
    return m.eval()


def hf_route(m, hidden):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m.gate(hidden)  # router_logits, weights, ids


def bias_of(m):
    return getattr(m.gate, "e_score_correction_bias", None)


# ---------------------------------------------------------------------------------------------
# route


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name,scoring,method,n_group,topk_group,top_k,norm,scale", ROUTINGS, ids=ROUTING_IDS)
def test_route_matches_transformers(name, scoring, method, n_group, topk_group, top_k, norm, scale, ties):
    m = hf_moe(scoring, method, n_group, topk_group, top_k, norm, scale)
    hidden = torch.randn(T, HIDDEN)
    if ties:  # many equal logits: same torch ops in the same order must break ties the same way
        m.gate.weight.data = torch.randint(-1, 2, (E, HIDDEN)).float()
        hidden = torch.randint(-1, 2, (T, HIDDEN)).float()
    logits, hf_w, hf_ids = hf_route(m, hidden)
    w, ids = route(logits, bias_of(m), top_k, scoring, method, n_group, topk_group, norm, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, top_k)
    for t in range(T):
        assert set(ids[t].tolist()) == set(hf_ids[t].tolist()), t
        by_id = dict(zip(hf_ids[t].tolist(), hf_w[t].tolist()))
        assert w[t].tolist() == [by_id[i] for i in ids[t].tolist()], t


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_route_softmax_norm_matches_transformers(method, n_group, topk_group):
    """transformers' V2 router never normalizes; with scale 1 its weights / their sum is ours."""
    m = hf_moe("softmax", method, n_group, topk_group, 3, False, 1.0)
    logits, hf_w, hf_ids = hf_route(m, torch.randn(T, HIDDEN))
    w, ids = route(logits, None, 3, "softmax", method, n_group, topk_group, True, 1.0)
    torch.testing.assert_close(ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, hf_w / (hf_w.sum(-1, keepdim=True) + 1e-20), rtol=0, atol=0)


def test_route_noaux_tc_uses_bias_to_choose_only():
    """A huge bias on one expert makes every token choose it, at its unbiased score."""
    logits = torch.randn(T, E)
    bias = torch.zeros(E)
    bias[5] = 100.0
    w, ids = route(logits, bias, 2, "sigmoid", "noaux_tc", 4, 2, False, 1.0)
    scores = logits.sigmoid()
    for t in range(T):
        assert 5 in ids[t].tolist()
        assert w[t, ids[t].tolist().index(5)].item() == scores[t, 5].item()


# ---------------------------------------------------------------------------------------------
# moe


def loop_moe(hidden, gate_up_proj, down_proj, weights, ids):
    """float64, one token and one routed expert at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = down_proj.shape[2]
    for t in range(hidden.shape[0]):
        h = hidden[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = gate_up_proj[e, :inter].double() @ h
            up = gate_up_proj[e, inter:].double() @ h
            out[t] += float(weights[t, k]) * (down_proj[e].double() @ (gate * torch.sigmoid(gate) * up))
    return out


def moe_args(m, hidden, routing, dtype=torch.float32):
    _, scoring, method, n_group, topk_group, top_k, norm, scale = routing
    logits = hf_route(m, hidden)[0]
    # Non-contiguous expert weights: a transposed copy transposed back.
    gate_up = m.experts.gate_up_proj.detach().transpose(1, 2).contiguous().transpose(1, 2).to(dtype)
    down = m.experts.down_proj.detach().to(dtype)
    return (hidden.to(dtype), logits, gate_up, down, bias_of(m), top_k, scoring, method, n_group, topk_group,
            norm, scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("routing", ROUTINGS[:2] + ROUTINGS[3:4], ids=ROUTING_IDS[:2] + ROUTING_IDS[3:4])
def test_moe_matches_loop(routing, dtype, tol):
    m = hf_moe(*routing[1:])
    hidden = torch.randn(T, HIDDEN + 4)[:, 2 : HIDDEN + 2]  # a non-contiguous slice
    args = moe_args(m, hidden, routing, dtype)
    out = moe_op(*args)
    assert out.dtype == dtype and out.shape == (T, HIDDEN)
    weights, ids = route(args[1], *args[4:])
    expected = loop_moe(args[0], args[2], args[3], weights, ids)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_oracle_expert_loop_equals_batched(monkeypatch, dtype):
    """The oracle runs large batches one expert at a time, small ones batched: the same numbers."""
    routing = ROUTINGS[3]
    m = hf_moe(*routing[1:])
    args = moe_args(m, torch.randn(T, HIDDEN), routing, dtype)
    batched = moe_all_experts(*args)
    monkeypatch.setattr(moe_module, "_BATCHED_MAX_ROWS", 0)
    looped = moe_all_experts(*args)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(looped.float(), batched.float(), rtol=tol, atol=tol * batched.abs().max().item())


@pytest.mark.parametrize("routing", [ROUTINGS[1], ROUTINGS[3], ROUTINGS[5]], ids=["v2", "v3", "v3_one_group"])
def test_moe_matches_transformers_experts(routing):
    """transformers' MoE block minus its shared experts: gate -> experts."""
    m = hf_moe(*routing[1:])
    hidden = torch.randn(T, HIDDEN)
    args = moe_args(m, hidden, routing)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, w, ids = m.gate(hidden)
        expected = m.experts(hidden, ids, w)
        full = m(hidden[None])[0] - m.shared_experts(hidden)
    out = moe_op(*args)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


@pytest.mark.parametrize(
    "routing,dtype",
    [(ROUTINGS[0], torch.float32), (ROUTINGS[1], torch.bfloat16), (ROUTINGS[3], torch.float32),
     (ROUTINGS[3], torch.bfloat16)],
    ids=["v2_lite-fp32", "v2-bf16", "v3-fp32", "v3-bf16"],
)
def test_moe_opcheck(routing, dtype):
    m = hf_moe(*routing[1:])
    torch.library.opcheck(moe_op, moe_args(m, torch.randn(T, HIDDEN), routing, dtype))


def test_moe_opcheck_noaux_tc_without_bias():
    m = hf_moe(*ROUTINGS[3][1:])
    args = list(moe_args(m, torch.randn(T, HIDDEN), ROUTINGS[3]))
    args[4] = None
    torch.library.opcheck(moe_op, tuple(args))


def _moe_error_cases():
    v3 = ROUTINGS[3]
    m = hf_moe(*v3[1:])
    h, logits, gu, down, bias = moe_args(m, torch.randn(T, HIDDEN), v3)[:5]
    meta = "meta"

    def args(**over):
        base = dict(h=h, logits=logits, gu=gu, down=down, bias=bias, top_k=3, scoring="sigmoid",
                    method="noaux_tc", n_group=4, topk_group=2, norm=True, scale=2.5)
        base.update(over)
        return tuple(base.values())

    return [
        ("hidden", args(h=h[None])),
        ("hidden", args(h=h.double())),
        ("router_logits", args(logits=logits[:-1])),  # T mismatch
        ("router_logits", args(logits=logits.to(torch.bfloat16))),
        ("router_logits", args(logits=logits.to(meta))),
        ("gate_up_proj", args(gu=gu[:-1])),  # E mismatch with router_logits
        ("gate_up_proj", args(gu=gu[..., :-1])),  # D mismatch
        ("gate_up_proj", args(gu=gu[:, :-1])),  # odd 2I
        ("gate_up_proj", args(gu=gu.to(torch.bfloat16))),
        ("gate_up_proj", args(gu=gu.to(meta))),
        ("down_proj", args(down=down[:-1])),  # E mismatch
        ("down_proj", args(down=down[..., :-2])),  # I mismatch
        ("down_proj", args(down=down.to(torch.bfloat16))),
        ("down_proj", args(down=down.to(meta))),
        ("e_score_correction_bias", args(bias=bias[:-1])),
        ("e_score_correction_bias", args(bias=bias.double())),
        ("e_score_correction_bias", args(bias=bias.to(meta))),
        ("e_score_correction_bias", args(scoring="softmax", method="greedy")),  # bias unused there
        ("scoring_func", args(scoring="relu")),
        ("topk_method", args(method="topk")),
        ("n_group", args(n_group=3)),  # does not divide E = 8
        ("n_group", args(n_group=0)),
        ("n_group", args(n_group=8, topk_group=4)),  # noaux_tc: 1 expert per group, needs 2
        ("topk_group", args(topk_group=5)),  # > n_group
        ("topk_group", args(topk_group=0)),
        ("top_k", args(top_k=0)),
        ("top_k", args(top_k=E + 1)),
        ("top_k", args(top_k=5)),  # > the 2 kept groups * 2 experts
        ("routed_scaling_factor", args(scale=0.0)),
    ]


@pytest.mark.parametrize("arg,args", _moe_error_cases())
def test_moe_bad_input(arg, args):
    helpers.assert_value_error(moe_op, args, helpers.arg_error(arg))


@pytest.mark.parametrize(
    "arg,args",
    [
        ("router_logits", (torch.randn(T, E).double(), None, 2, "softmax", "greedy", 1, 1, False, 1.0)),
        ("top_k", (torch.randn(T, E), None, 9, "softmax", "greedy", 1, 1, False, 1.0)),
        ("n_group", (torch.randn(T, E), None, 2, "softmax", "group_limited_greedy", 3, 1, False, 1.0)),
    ],
)
def test_route_bad_input(arg, args):
    helpers.assert_value_error(route, args, helpers.arg_error(arg))


def test_moe_compile_matches_eager():
    routing = ROUTINGS[3]
    m = hf_moe(*routing[1:])
    args = moe_args(m, torch.randn(T, HIDDEN), routing, torch.bfloat16)

    def fn(hidden, *rest):
        return moe_op(hidden * 2.0, *rest)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# grouped by expert: against the all-experts oracle, work, syncs; fp8 experts


def random_moe_args(T_, E_, D_, I_, routing, dtype=torch.float32, fp8=False, seed=0):
    """moe arguments with random experts [E, 2I, D] / [E, D, I] (e4m3 + block scales if fp8)."""
    _, scoring, method, n_group, topk_group, top_k, norm, scale = routing
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T_, D_, generator=g).to(dtype)
    logits = torch.randn(T_, E_, generator=g)
    bias = torch.rand(E_, generator=g) * 0.1 if method == "noaux_tc" else None
    gate_up = torch.randn(E_, 2 * I_, D_, generator=g) * D_**-0.5
    down = torch.randn(E_, D_, I_, generator=g) * I_**-0.5
    if fp8:
        (gate_up, gu_scale), (down, d_scale) = quantize_blockwise(gate_up), quantize_blockwise(down)
    else:
        gate_up, down, gu_scale, d_scale = gate_up.to(dtype), down.to(dtype), None, None
    return (hidden, logits, gate_up, down, bias, top_k, scoring, method, n_group, topk_group, norm, scale,
            gu_scale, d_scale)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])  # 1 token: 5 of 8 experts get no rows
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("routing", ROUTINGS[:2] + ROUTINGS[3:4], ids=ROUTING_IDS[:2] + ROUTING_IDS[3:4])
def test_grouped_moe_matches_all_experts_oracle(routing, dtype, tol, num_tokens):
    args = random_moe_args(num_tokens, E, HIDDEN, INTER, routing, dtype)
    out, expected = moe_op(*args), moe_all_experts(*args)
    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_group_fallback_equals_grouped_mm(monkeypatch, dtype):
    """Where F.grouped_mm does not run on CPU, one matmul per group gives the same numbers."""
    args = random_moe_args(7, E, HIDDEN, INTER, ROUTINGS[3], dtype)
    grouped = moe_op(*args)
    monkeypatch.setattr(moe_module, "_grouped_mm_runs", lambda device_type, dtype: False)
    per_group = moe_op(*args)
    torch.testing.assert_close(per_group, grouped, rtol=0, atol=0)


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums 2*M*N*K over mm/bmm/matmul-like aten calls, grouped_mm included (all rows real)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten._grouped_mm.default):
            a, b = args[0], args[1]
            batch = b.shape[0] if func is torch.ops.aten.bmm.default else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return out


@pytest.mark.parametrize("num_experts", [8, 64])
def test_grouped_moe_work_is_proportional_to_routed_rows(num_experts):
    """Matmul FLOPs are exactly the routed rows' (T*k rows through gate_up and down), whatever
    the number of experts; the oracle's grow with E."""
    routing = ROUTINGS[0]  # greedy softmax, top-3
    num_tokens, top_k = 4, routing[5]
    args = random_moe_args(num_tokens, num_experts, HIDDEN, INTER, routing)
    with _MatmulFlops() as grouped:
        op_body("mlagraph::moe")(*args)  # the op's body, so the mode sees the aten calls inside
    assert grouped.flops == 2 * num_tokens * top_k * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    with _MatmulFlops() as oracle:
        moe_all_experts(*args)
    assert oracle.flops == grouped.flops * num_experts // top_k


def test_grouped_moe_has_no_host_sync():
    with helpers.NoHostSync() as mode:
        out = moe_op(*random_moe_args(5, E, HIDDEN, INTER, ROUTINGS[3], torch.bfloat16))
    assert "mlagraph::moe" in mode.ops_seen and torch.isfinite(out).all()


FP8_D, FP8_I = 160, 136  # ragged 128-blocks: gate_up [E, 272, 160] -> 3 x 2 scales, down 2 x 2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fp8_experts_equal_their_dequantized_weights(dtype, tol):
    """fp8 experts compute with exactly the weights their blocks stand for (float64 loop too)."""
    args = random_moe_args(5, E, FP8_D, FP8_I, ROUTINGS[3], dtype, fp8=True)
    gate_up = dequantize_blockwise(args[2], args[12], torch.float32)
    down = dequantize_blockwise(args[3], args[13], torch.float32)
    deq_args = (*args[:2], gate_up.to(dtype), down.to(dtype), *args[4:12])
    out = moe_op(*args)
    torch.testing.assert_close(out, moe_op(*deq_args), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), moe_all_experts(*args).float(), rtol=tol, atol=tol * out.abs().max().item())
    expected = loop_moe(args[0], gate_up, down, *route(args[1], *args[4:12]))
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_opcheck_fp8_experts(dtype):
    helpers.opcheck(moe_op, random_moe_args(4, E, FP8_D, FP8_I, ROUTINGS[3], dtype, fp8=True))


def _fp8_moe_error_cases():
    base = random_moe_args(4, E, FP8_D, FP8_I, ROUTINGS[3], fp8=True)

    def args(**over):
        a = list(base)
        for i, v in over.items():
            a[int(i[1:])] = v
        return tuple(a)

    gu, down, gs, ds = base[2], base[3], base[12], base[13]
    return [
        ("down_scale", args(a13=None)),  # one scale without the other
        ("gate_up_scale", args(a12=None)),
        ("gate_up_proj", args(a2=gu.float())),  # scales given, weights not fp8
        ("down_proj", args(a3=down.to(torch.float8_e5m2))),
        ("gate_up_scale", args(a12=gs[:, :-1])),  # one 128-row block short
        ("gate_up_scale", args(a12=gs[..., :1])),
        ("down_scale", args(a13=ds[:-1])),  # expert count
        ("down_scale", args(a13=ds.double())),
        ("down_scale", args(a13=ds.to("meta"))),
        ("gate_up_proj", args(a12=None, a13=None)),  # fp8 weights without scales
    ]


@pytest.mark.parametrize("arg,args", _fp8_moe_error_cases())
def test_moe_bad_fp8_input(arg, args):
    helpers.assert_value_error(moe_op, args, helpers.arg_error(arg))


@pytest.mark.gpu
def test_moe_cuda_graph_capture():
    """The op captures in a CUDA graph (no host syncs) and replays on new tokens."""
    routing = ROUTINGS[3]
    m = hf_moe(*routing[1:])
    args = moe_args(m, torch.randn(T, HIDDEN), routing)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    graph, out = capture_cuda_graph(lambda: moe_op(*args))
    args[0].copy_(torch.randn_like(args[0]))
    args[1].copy_(torch.randn_like(args[1]))
    graph.replay()
    torch.testing.assert_close(out, moe_op(*args), rtol=1e-5, atol=1e-5)


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.gpu
def test_grouped_mm_runs_on_cuda_bf16():
    """The H200 runs F.grouped_mm for bfloat16 (ANCHORS.md), so the model's moe is the grouped
    path there, not the all-experts fallback."""
    assert moe_module._grouped_mm_runs("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_grouped_moe_matches_oracle_at_v3_dims(num_tokens, fp8, whole_gpu_memory):
    """DeepSeek-V3's MoE layer: 256 experts of [2*2048, 7168], top-8 of 8 groups (4 kept).
    fp8 at 2048 tokens (64 rows per expert) also quantizes the activations per 1x128 group
    (W8A8) before each of the two GEMMs: e4m3's rounding is 2.6% relative per GEMM for normal
    activations (tests/ops/test_fp8.py), 4.4% through both on the H200 (2026-12-02), so 6e-2
    there and 1e-2 elsewhere."""
    from benchmarks.common import V3_MOE, moe_layer_args

    args = moe_layer_args(num_tokens, device="cuda", fp8=fp8, **V3_MOE)
    out = moe_op(*args)
    want = moe_all_experts(*args).float()
    rel = (out.float() - want).norm() / want.norm()
    assert out.dtype == torch.bfloat16 and rel < (6e-2 if fp8 and num_tokens == 2048 else 1e-2), rel


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_grouped_moe_cuda_graph_capture(fp8):
    """bf16 (the grouped path) and fp8 experts capture and replay on new tokens and routes."""
    args = _cuda(random_moe_args(16, E, FP8_D, FP8_I, ROUTINGS[3], torch.bfloat16, fp8=fp8))
    graph, out = capture_cuda_graph(lambda: moe_op(*args))
    args[0].copy_(torch.randn_like(args[0]))
    args[1].copy_(torch.randn_like(args[1]))
    graph.replay()
    torch.testing.assert_close(out, moe_op(*args), rtol=0, atol=0)
    want = moe_all_experts(*args).float()
    assert ((out.float() - want).norm() / want.norm()) < 1e-2


def _expert_shard(args, first: int, count: int):
    """moe arguments holding only experts first .. first+count-1 (expert parallel), scales too."""
    a = list(args)
    for i in (2, 3, 12, 13):
        if a[i] is not None:
            a[i] = a[i][first : first + count].contiguous()
    return (*a, first)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_expert_shards_sum_to_the_whole_layer(ranks, num_tokens, fp8):
    """Expert parallel: each rank's share (first_expert, E/ranks local experts) through the
    grouped path and the all-experts oracle; the shares sum to the whole layer."""
    d, i = (FP8_D, FP8_I) if fp8 else (HIDDEN, INTER)
    args = random_moe_args(num_tokens, E, d, i, ROUTINGS[3], fp8=fp8)
    whole = moe_op(*args)
    local = E // ranks
    shares = [moe_op(*_expert_shard(args, r * local, local)) for r in range(ranks)]
    torch.testing.assert_close(sum(shares), whole, rtol=1e-5, atol=1e-5)
    oracle = [moe_all_experts(*_expert_shard(args, r * local, local)) for r in range(ranks)]
    for got, want in zip(shares, oracle):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_expert_shard_opcheck():
    helpers.opcheck(moe_op, _expert_shard(random_moe_args(5, E, HIDDEN, INTER, ROUTINGS[3]), 4, 4))


@pytest.mark.parametrize(
    "first,count", [(6, 4), (-1, 4), (0, 9)], ids=["past the end", "negative", "more than router"]
)
def test_expert_shard_bad_first_expert(first, count):
    args = random_moe_args(5, E, HIDDEN, INTER, ROUTINGS[3])
    if count > E:  # more local experts than the router scores
        a = list(args)
        a[2], a[3] = torch.cat([a[2], a[2][:1]]), torch.cat([a[3], a[3][:1]])
        shard = (*a, first)
    else:
        shard = _expert_shard(args, 0, count)[:-1] + (first,)  # 4 experts, said to start at first
    helpers.assert_value_error(moe_op, shard, helpers.arg_error("first_expert"))


# ---------------------------------------------------------------------------------------------
# shared experts in the same call


def random_shared(D_, I_s, dtype=torch.float32, fp8=False, seed=1):
    """The op's six shared-expert arguments: gate / up [I_s, D], down [D, I_s] (e4m3 + their
    block scales if fp8, else the scales None)."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(I_s, D_, generator=g) * D_**-0.5 for _ in range(2))
    down = torch.randn(D_, I_s, generator=g) * I_s**-0.5
    if not fp8:
        return gate.to(dtype), up.to(dtype), down.to(dtype), None, None, None
    (gate, gs), (up, us), (down, ds) = (quantize_blockwise(w) for w in (gate, up, down))
    return gate, up, down, gs, us, ds


def loop_shared(hidden, gate, up, down):
    """float64: down(silu(gate h) * up h) for every token."""
    h = hidden.double()
    g, u = h @ gate.double().T, h @ up.double().T
    return (g * torch.sigmoid(g) * u) @ down.double().T


def _dequantized_shared(shared):
    gate, up, down, *scales = shared
    if scales[0] is None:
        return gate, up, down
    return tuple(dequantize_blockwise(w, s, torch.float32) for w, s in zip((gate, up, down), scales))


def with_shared_args(args, shared, first_expert=None):
    """moe's arguments (routed, 14 of them) followed by first_expert and the shared experts."""
    return (*args[:14], *(None,) * (14 - len(args[:14])), first_expert, *shared)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_shared_experts_add_their_mlp(dtype, tol, num_tokens, fp8):
    """With shared experts the op is the routed experts plus the shared MLP (float64 loops,
    fp8 weights as their blocks stand for), and the all-experts oracle agrees."""
    d, i = (FP8_D, FP8_I) if fp8 else (HIDDEN, INTER)
    args = random_moe_args(num_tokens, E, d, i, ROUTINGS[3], dtype, fp8=fp8)
    shared = random_shared(d, 2 * i, dtype, fp8)
    out = moe_op(*with_shared_args(args, shared))
    assert out.dtype == dtype and out.shape == (num_tokens, d)
    routed = [args[2], args[3]] if not fp8 else [dequantize_blockwise(args[2], args[12], torch.float32),
                                                 dequantize_blockwise(args[3], args[13], torch.float32)]
    want = loop_moe(args[0], *routed, *route(args[1], *args[4:12])) + loop_shared(args[0], *_dequantized_shared(shared))
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    oracle = moe_all_experts(*with_shared_args(args, shared))
    torch.testing.assert_close(out.float(), oracle.float(), rtol=tol, atol=tol * oracle.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_experts_round_as_the_model_adds(dtype):
    """The op's result is routed + shared, each rounded to hidden's dtype and added in it (the
    model's ``routed + shared`` before the fold): bit for bit against the two computed apart."""
    args = random_moe_args(6, E, HIDDEN, INTER, ROUTINGS[1], dtype)
    shared = random_shared(HIDDEN, INTER, dtype)
    apart = moe_op(*args[:12]) + moe_module.shared_experts(args[0], *shared)
    torch.testing.assert_close(moe_op(*with_shared_args(args, shared)), apart, rtol=0, atol=0)


@pytest.mark.parametrize("routing", [ROUTINGS[1], ROUTINGS[3]], ids=["v2", "v3"])
def test_moe_with_shared_matches_transformers_block(routing):
    """transformers' whole MoE block (gate -> experts + shared experts) from one call."""
    m = hf_moe(*routing[1:])
    hidden = torch.randn(T, HIDDEN)
    s = m.shared_experts
    shared = (s.gate_proj.weight.detach(), s.up_proj.weight.detach(), s.down_proj.weight.detach())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = m(hidden[None])[0]
    out = moe_op(*moe_args(m, hidden, routing), None, None, None, *shared)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_shards_with_shared_slices_sum_to_the_whole_layer(ranks, fp8):
    """Expert parallel: each rank runs its experts and its 1/ranks of the shared width (gate and
    up rows, down columns; whole 128-blocks for fp8); the shares sum to the whole layer."""
    d, i = (FP8_D, 128) if fp8 else (HIDDEN, INTER)
    args = random_moe_args(5, E, d, i, ROUTINGS[3], fp8=fp8)
    width = 128 * ranks if fp8 else 4 * ranks
    gate, up, down, gs, us, ds = random_shared(d, width, fp8=fp8)
    whole = moe_op(*with_shared_args(args, (gate, up, down, gs, us, ds)))
    local, cut = E // ranks, width // ranks
    shares = []
    for r in range(ranks):
        rows = slice(r * cut, (r + 1) * cut)
        blocks = slice(r * cut // 128, (r + 1) * cut // 128) if fp8 else None
        sliced = (gate[rows], up[rows], down[:, rows].contiguous(),
                  *((gs[blocks], us[blocks], ds[:, blocks].contiguous()) if fp8 else (None,) * 3))
        shard = _expert_shard(args, r * local, local)
        shares.append(moe_op(*with_shared_args(shard[:14], sliced, shard[14])))
    torch.testing.assert_close(sum(shares), whole, rtol=1e-4, atol=1e-4 * whole.abs().max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_moe_opcheck_with_shared(fp8):
    d, i = (FP8_D, FP8_I) if fp8 else (HIDDEN, INTER)
    args = random_moe_args(4, E, d, i, ROUTINGS[3], torch.bfloat16, fp8=fp8)
    helpers.opcheck(moe_op, with_shared_args(args, random_shared(d, 2 * i, torch.bfloat16, fp8)))


def _shared_error_cases():
    args = random_moe_args(4, E, HIDDEN, INTER, ROUTINGS[3])
    gate, up, down, *_ = random_shared(HIDDEN, 12)  # I_s = 12 != D = 16: a transpose is caught
    fp8_args = random_moe_args(4, E, FP8_D, FP8_I, ROUTINGS[3], fp8=True)
    f_gate, f_up, f_down, gs, us, ds = random_shared(FP8_D, FP8_I, fp8=True)

    def call(*shared, routed=args):
        return with_shared_args(routed, shared + (None,) * (6 - len(shared)))

    def fp8_call(*shared):
        return call(*shared, routed=fp8_args)

    return [
        ("shared_up_proj", call(gate, None, down)),  # one weight missing
        ("shared_down_proj", call(gate, up, None)),
        ("shared_gate_scale", call(None, None, None, gs, us, ds)),  # scales, no weights
        ("shared_gate_proj", call(gate[None], up, down)),  # not 2-D
        ("shared_gate_proj", call(gate[:, :-1], up, down)),  # D mismatch
        ("shared_up_proj", call(gate, up[:-1], down)),  # I_s mismatch
        ("shared_down_proj", call(gate, up, down.T.contiguous())),
        ("shared_up_proj", call(gate, up.double(), down)),  # dtype is not hidden's
        ("shared_gate_proj", call(gate.to("meta"), up, down)),
        ("shared_down_scale", fp8_call(f_gate, f_up, f_down, gs, us, None)),  # one scale missing
        ("shared_gate_proj", fp8_call(f_gate.float(), f_up, f_down, gs, us, ds)),  # scales, weights not fp8
        ("shared_up_scale", fp8_call(f_gate, f_up, f_down, gs, us[:-1], ds)),  # one 128-block short
        ("shared_down_scale", fp8_call(f_gate, f_up, f_down, gs, us, ds.double())),
        ("shared_gate_proj", fp8_call(f_gate, f_up, f_down)),  # fp8 weights without scales
    ]


@pytest.mark.parametrize("arg,args", _shared_error_cases())
def test_moe_bad_shared_input(arg, args):
    helpers.assert_value_error(moe_op, args, helpers.arg_error(arg))


def test_moe_bad_shared_input_corrupts_nothing():
    """A failed call leaves its inputs as they were."""
    args = random_moe_args(4, E, HIDDEN, INTER, ROUTINGS[3])
    gate, up, down, *_ = random_shared(HIDDEN, 2 * INTER)
    before = [a.clone() for a in (args[0], gate, up, down)]
    with pytest.raises(ValueError):
        moe_op(*with_shared_args(args, (gate, up[:-1], down, None, None, None)))
    for a, b in zip((args[0], gate, up, down), before):
        assert torch.equal(a, b)
