"""mla_decode against an independent float64 loop over requests, queries, heads and keys.

Caches are built with the layouts helpers directly (quantize_latent + scatter_rows) into a cache
whose unwritten rows are NaN, so reading a row past a request's length, through a wrong page or
through a -1 page shows up as NaN. The cache helpers here are shared with test_sparse.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlagraph.ops import layouts
from tests import helpers
from tests.helpers import arg_error, assert_value_error, make_block_table, slots_for

mla_decode = torch.ops.mlagraph.mla_decode
mha_prefill = torch.ops.mlagraph.mha_prefill

L, R, H = 128, 32, 2  # fp8_ds needs L divisible by 128
SM_SCALE = 0.1352
FP8_SCALE = 1 / 64  # keeps randn / scale well inside e4m3's +-448

# cache kind -> (layout, model dtype). "bf16-f32": the bf16 layout holding float32 rows.
CACHE_KINDS = {
    "bf16-f32": ("bf16", torch.float32),
    "bf16": ("bf16", torch.bfloat16),
    "fp8": ("fp8", torch.float32),
    "fp8_ds": ("fp8_ds", torch.float32),
}


def poisoned_cache(layout: str, model_dtype: torch.dtype, num_pages: int, page_size: int) -> torch.Tensor:
    """A cache whose every row is NaN (all-ones bytes for fp8_ds: NaN e4m3 and NaN scales)."""
    shape = (num_pages, page_size, layouts.latent_row_width(layout, L, R))
    dtype = layouts.latent_storage_dtype(layout, model_dtype)
    if dtype == torch.uint8:
        return torch.full(shape, 255, dtype=torch.uint8)
    return torch.full(shape, float("nan")).to(dtype)


def build_cache(kind: str, seq_lens: list[int], page_size: int, *, seed: int = 0, pad_pages: int = 2):
    """Random latents for positions 0..n-1 of every request, written into a poisoned paged cache.

    Returns (cache, scale, block_table, written) with written[b] = (kv_c [n, L], k_pe [n, R]) float64,
    the exact values handed to the writer (already rounded to bf16 for bf16 storage).
    """
    layout, model_dtype = CACHE_KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3  # a few never-used pages
    table = make_block_table(seq_lens, page_size, num_pages, seed=seed, pad_pages=pad_pages)
    cache = poisoned_cache(layout, model_dtype, num_pages, page_size)
    scale = torch.tensor([FP8_SCALE]) if layout == "fp8" else None
    written = []
    for b, n in enumerate(seq_lens):
        kv_c = torch.randn(n, L, generator=g).to(model_dtype)
        k_pe = torch.randn(n, R, generator=g).to(model_dtype)
        written.append((kv_c.double(), k_pe.double()))
        if n:
            rows = layouts.quantize_latent(layout, kv_c, k_pe, scale, cache.dtype)
            layouts.scatter_rows(cache, torch.tensor(slots_for(table, page_size, b, range(n))), rows)
    return cache, scale, table, written


def paged_keys(kind: str, cache: torch.Tensor, scale, table: torch.Tensor):
    """key(b, p) -> (kv_c [L], k_pe [R]) float64 of request b's position p, found by walking the
    block table over the cache as the layouts helpers dequantize it."""
    kv_c, k_pe = layouts.dequantize_latent(CACHE_KINDS[kind][0], cache, R, scale, torch.float64)
    page_size = cache.shape[1]

    def key(b: int, p: int):
        page = int(table[b, p // page_size])
        return kv_c[page, p % page_size], k_pe[page, p % page_size]

    return key


def written_keys(written):
    return lambda b, p: (written[b][0][p], written[b][1][p])


def ref_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, keys: list, sm_scale: float):
    """One query head over keys [(kv_c [L], k_pe [R]), ...] in float64 -> (out [L], lse)."""
    if not keys:
        return torch.zeros(q_nope.shape[-1], dtype=torch.float64), -math.inf
    scores = [sm_scale * (float(q_nope.double() @ kv) + float(q_pe.double() @ pe)) for kv, pe in keys]
    m = max(scores)
    z = sum(math.exp(s - m) for s in scores)
    out = sum((math.exp(s - m) / z) * kv for s, (kv, _) in zip(scores, keys))
    return out, m + math.log(z)


def ref_decode(q_nope, q_pe, key, seq_lens: list[int], sm_scale: float):
    batch, s_q, heads, latent = q_nope.shape
    out = torch.zeros(batch, s_q, heads, latent, dtype=torch.float64)
    lse = torch.full((batch, s_q, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for i in range(s_q):
            last = seq_lens[b] - s_q + i  # this query's own position
            keys = [key(b, p) for p in range(last + 1)]
            for h in range(heads):
                out[b, i, h], lse[b, i, h] = ref_attention(q_nope[b, i, h], q_pe[b, i, h], keys, sm_scale)
    return out, lse


def make_q(shape_prefix: tuple, dtype=torch.float32, seed: int = 1):
    """q_nope [..., L] and q_pe [..., R] as non-contiguous slices of one tensor, as the model makes them."""
    q = torch.randn(*shape_prefix, L + R, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q[..., :L], q[..., L:]


# ---------------------------------------------------------------------------------------------
# numerics

SEQ_LENS = [5, 0, 19, 36]  # ragged, with a padding request


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_matches_loop(kind, s_q, page_size):
    cache, scale, table, written = build_cache(kind, SEQ_LENS, page_size)
    q_nope, q_pe = make_q((len(SEQ_LENS), s_q, H))
    out, lse = mla_decode(q_nope, q_pe, cache, table, torch.tensor(SEQ_LENS, dtype=torch.int32), scale,
                          CACHE_KINDS[kind][0], SM_SCALE)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    # bf16 layouts are read exactly: compare with the values written. fp8 layouts: with the
    # dequantized cache, so only the attention math is under test.
    key = written_keys(written) if kind.startswith("bf16") else paged_keys(kind, cache, scale, table)
    ref_out, ref_lse = ref_decode(q_nope, q_pe, key, SEQ_LENS, SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -math.inf)  # padding request


def test_bf16_queries():
    cache, scale, table, written = build_cache("bf16", SEQ_LENS, 16)
    q_nope, q_pe = make_q((len(SEQ_LENS), 3, H), dtype=torch.bfloat16)
    out, lse = mla_decode(q_nope, q_pe, cache, table, torch.tensor(SEQ_LENS, dtype=torch.int32), None, "bf16", SM_SCALE)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = ref_decode(q_nope, q_pe, written_keys(written), SEQ_LENS, SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1.6e-2)  # out rounded to bf16
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # lse stays float32


def test_short_request_sees_no_key_before_its_start():
    # seq_lens 2 < s_q 3: the first query's position is -1, so it sees nothing.
    cache, scale, table, written = build_cache("bf16-f32", [2, 7], 4)
    q_nope, q_pe = make_q((2, 3, H))
    out, lse = mla_decode(q_nope, q_pe, cache, table, torch.tensor([2, 7], dtype=torch.int32), None, "bf16", SM_SCALE)
    ref_out, ref_lse = ref_decode(q_nope, q_pe, written_keys(written), [2, 7], SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[0, 0] == 0) and torch.all(lse[0, 0] == -math.inf)


def test_non_contiguous_cache_and_metadata():
    cache, scale, table, _ = build_cache("fp8_ds", SEQ_LENS, 16)
    q_nope, q_pe = make_q((len(SEQ_LENS), 3, H))
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    want = mla_decode(q_nope, q_pe, cache, table, seq_lens, scale, "fp8_ds", SM_SCALE)
    # A layer's cache as a view into an interleaved [pages, layers, page_size, W] allocation.
    both = torch.full((cache.shape[0], 2, *cache.shape[1:]), 255, dtype=torch.uint8)
    both[:, 1] = cache
    table_nc = table.t().contiguous().t()
    seq_lens_nc = torch.stack([seq_lens, seq_lens], dim=1)[:, 0]
    assert not both[:, 1].is_contiguous() and not table_nc.is_contiguous() and not seq_lens_nc.is_contiguous()
    got = mla_decode(q_nope, q_pe, both[:, 1], table_nc, seq_lens_nc, scale, "fp8_ds", SM_SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_absorbed_equals_mha_over_expanded_keys():
    """Absorbing W_UK into q and W_UV after attention gives MHA's result on expanded k/v, and the
    same lse: the two ops agree on which keys each new token sees."""
    seq_lens, s_q, nope, vdim = [7, 12], 2, 16, 8
    g = torch.Generator().manual_seed(3)
    w_uk, w_uv = torch.randn(H, nope, L, generator=g) / 8, torch.randn(H, vdim, L, generator=g) / 8
    cache, _, table, written = build_cache("bf16-f32", seq_lens, 4)
    q_head = torch.randn(2, s_q, H, nope, generator=g)
    q_pe = torch.randn(2, s_q, H, R, generator=g)

    q_abs = torch.einsum("bqhd,hdl->bqhl", q_head, w_uk)
    lat, lse_dec = mla_decode(q_abs, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32), None, "bf16",
                              SM_SCALE)
    out_dec = torch.einsum("bqhl,hvl->bqhv", lat, w_uv)

    kv_c = torch.cat([w[0] for w in written]).float()
    k_pe = torch.cat([w[1] for w in written]).float()
    k = torch.cat([torch.einsum("sl,hdl->shd", kv_c, w_uk), k_pe[:, None].expand(-1, H, -1)], dim=-1)
    v = torch.einsum("sl,hvl->shv", kv_c, w_uv)
    q = torch.cat([q_head, q_pe], dim=-1).reshape(2 * s_q, H, nope + R)
    cu_q = torch.tensor([0, s_q, 2 * s_q], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 19], dtype=torch.int32)
    out_mha, lse_mha = mha_prefill(q, k, v, cu_q, cu_k, SM_SCALE, True)
    torch.testing.assert_close(out_dec.reshape(2 * s_q, H, vdim), out_mha, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_dec.reshape(2 * s_q, H), lse_mha, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# opcheck, compile


def decode_args(kind: str, s_q: int, seq_lens=(3, 0, 9), page_size: int = 4):
    cache, scale, table, _ = build_cache(kind, list(seq_lens), page_size)
    q_nope, q_pe = make_q((len(seq_lens), s_q, H))
    return [q_nope, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale, CACHE_KINDS[kind][0],
            SM_SCALE]


@pytest.mark.parametrize("kind,s_q", [("bf16-f32", 1), ("bf16", 3), ("fp8", 1), ("fp8_ds", 3)])
def test_opcheck(kind, s_q):
    helpers.opcheck(mla_decode, decode_args(kind, s_q))


def test_compile_matches_eager():
    def step(q_nope, q_pe, cache, table, seq_lens, scale):
        out, lse = mla_decode(q_nope, q_pe, cache, table, seq_lens, scale, "fp8", SM_SCALE)
        return out * 2, lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for seq_lens in [(3, 0, 9), (4, 11, 2, 6)]:
        args = decode_args("fp8", 1, seq_lens)[:6]
        for got, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# bad input

ARGS = ["q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "scale", "layout", "softmax_scale"]


def _set(**kw):
    return lambda a: a.update(kw)


BAD = [
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"][0])),  # 3-d
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"].to(torch.int32))),
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"][..., :96], q_pe=a["q_pe"], layout="fp8_ds")),  # L % 128
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"][:, :, :1])),  # heads differ from q_nope
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"][:2])),  # batch differs
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"].to(torch.bfloat16))),
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"].to("meta"))),
    ("layout", _set(layout="fp16")),
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][..., :-1])),  # wrong width for layout
    ("kv_cache", lambda a: a.update(layout="fp8_ds")),  # fp8 cache read as fp8_ds: width and dtype
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].float(), scale=a["scale"])),  # fp8 needs e4m3
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][0])),  # 2-d
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].to("meta"))),
    ("scale", _set(scale=None)),
    ("scale", lambda a: a.update(scale=a["scale"].double())),
    ("scale", lambda a: a.update(scale=a["scale"].expand(2))),
    ("scale", lambda a: a.update(scale=a["scale"].to("meta"))),
    ("block_table", lambda a: a.update(block_table=a["block_table"].long())),
    ("block_table", lambda a: a.update(block_table=a["block_table"][:2])),
    ("block_table", lambda a: a.update(block_table=a["block_table"][0])),
    ("block_table", lambda a: a.update(block_table=a["block_table"].to("meta"))),
    ("seq_lens", lambda a: a.update(seq_lens=torch.cat([a["seq_lens"], a["seq_lens"][:1]]))),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].long())),
    ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].to("meta"))),
    ("softmax_scale", _set(softmax_scale=0.0)),
    ("softmax_scale", _set(softmax_scale=-0.1)),
]


@pytest.mark.parametrize("arg,mutate", BAD, ids=[f"{i}-{arg}" for i, (arg, _) in enumerate(BAD)])
def test_bad_input(arg, mutate):
    a = dict(zip(ARGS, decode_args("fp8", 2)))
    mutate(a)
    assert_value_error(mla_decode, [a[n] for n in ARGS], arg_error(arg))
