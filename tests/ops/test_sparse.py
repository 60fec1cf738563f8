"""sparse_mla against an independent float64 loop, and against mla_decode (dense == sparse).

Caches come from test_decode.py's helpers: NaN in every unwritten row, so a -1 index or a -1
page that is read instead of skipped shows up as NaN.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests import helpers
from tests.helpers import arg_error, assert_value_error
from tests.ops.test_decode import (
    CACHE_KINDS,
    H,
    SM_SCALE,
    build_cache,
    make_q,
    paged_keys,
    ref_attention,
    ref_decode,
    written_keys,
)

sparse_mla = torch.ops.mlagraph.sparse_mla
mla_decode = torch.ops.mlagraph.mla_decode

SEQ_LENS = [6, 21, 0, 40]
# (request, position) of each query token; request 2 is padding (its token selects nothing)
TOKENS = [(0, 5), (1, 0), (1, 20), (3, 39), (3, 7), (2, 0), (1, 13)]
TOPK = 8


def make_topk(tokens, k: int = TOPK, seed: int = 0, empty=(5,)) -> torch.Tensor:
    """[T, k] int32: distinct random visible positions (<= the token's own), -1 mixed in
    anywhere; the tokens in ``empty`` select nothing."""
    rng = random.Random(seed)
    rows = []
    for t, (_, pos) in enumerate(tokens):
        picked = [] if t in empty else rng.sample(range(pos + 1), min(k, pos + 1))
        row = picked + [-1] * (k - len(picked))
        rng.shuffle(row)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def ref_sparse(q_nope, q_pe, key, tokens, topk, sm_scale):
    num_tokens, heads, latent = q_nope.shape
    out = torch.zeros(num_tokens, heads, latent, dtype=torch.float64)
    lse = torch.full((num_tokens, heads), -math.inf, dtype=torch.float64)
    for t, (req, _) in enumerate(tokens):
        keys = [key(req, int(p)) for p in topk[t] if p >= 0]
        for h in range(heads):
            out[t, h], lse[t, h] = ref_attention(q_nope[t, h], q_pe[t, h], keys, sm_scale)
    return out, lse


def sparse_args(kind: str, page_size: int = 16, q_dtype=torch.float32, k: int = TOPK):
    cache, scale, table, written = build_cache(kind, SEQ_LENS, page_size)
    q_nope, q_pe = make_q((len(TOKENS), H), dtype=q_dtype)
    topk = make_topk(TOKENS, k)
    req_ids = torch.tensor([r for r, _ in TOKENS], dtype=torch.int32)
    args = [q_nope, q_pe, cache, topk, req_ids, table, scale, CACHE_KINDS[kind][0], SM_SCALE]
    return args, written


# ---------------------------------------------------------------------------------------------
# numerics


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_matches_loop(kind, page_size):
    args, written = sparse_args(kind, page_size)
    q_nope, q_pe, cache, topk, _, table, scale = args[:7]
    out, lse = sparse_mla(*args)
    assert out.shape == q_nope.shape and out.dtype == torch.float32 and lse.dtype == torch.float32
    # bf16 layouts: the exact values written; fp8 layouts: the dequantized cache (attention math only).
    key = written_keys(written) if kind.startswith("bf16") else paged_keys(kind, cache, scale, table)
    ref_out, ref_lse = ref_sparse(q_nope, q_pe, key, TOKENS, topk, SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[5] == 0) and torch.all(lse[5] == -math.inf)  # the token with all -1


def test_bf16_queries():
    args, written = sparse_args("bf16", q_dtype=torch.bfloat16)
    out, lse = sparse_mla(*args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = ref_sparse(args[0], args[1], written_keys(written), TOKENS, args[3], SM_SCALE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1.6e-2)  # out rounded to bf16
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_indices_without_a_page_are_skipped():
    """Positions past the block table's reach, or on a -1 page, are ignored like -1: never an
    out-of-range read, never a clamped neighbour, never the row a -1 slot would wrap to."""
    cache, scale, table, _ = build_cache("bf16-f32", SEQ_LENS, 16, pad_pages=0)  # table exactly 3 pages wide
    q_nope, q_pe = make_q((len(TOKENS), H))
    req_ids = torch.tensor([r for r, _ in TOKENS], dtype=torch.int32)
    topk = make_topk(TOKENS)
    topk[3, 0] = -1
    want = sparse_mla(q_nope, q_pe, cache, topk, req_ids, table, scale, "bf16", SM_SCALE)
    bad = topk.clone()
    bad[0, topk[0] == -1] = 20  # request 0 has one page: position 20 is on a -1 page
    bad[3, 0] = table.shape[1] * cache.shape[1]  # request 3 fills all 3 pages: one past the table
    got = sparse_mla(q_nope, q_pe, cache, bad, req_ids, table, scale, "bf16", SM_SCALE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_all_visible_equals_decode(kind):
    """topk = every visible position gives mla_decode's s_q = 1 result (and the dense loop's):
    bit for bit when the positions come in order over the table's full width, to float32
    rounding when they are shuffled among extra -1 entries."""
    seq_lens = [5, 0, 19, 36]
    cache, scale, table, written = build_cache(kind, seq_lens, 16)
    layout, page_size = CACHE_KINDS[kind][0], cache.shape[1]
    q_nope, q_pe = make_q((len(seq_lens), 1, H))
    dense = mla_decode(q_nope, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32), scale, layout, SM_SCALE)

    width = table.shape[1] * page_size
    pos = torch.arange(width)
    in_order = torch.where(pos[None, :] < torch.tensor(seq_lens)[:, None], pos[None, :], -1).to(torch.int32)
    req_ids = torch.arange(len(seq_lens), dtype=torch.int32)
    sparse = sparse_mla(q_nope[:, 0], q_pe[:, 0], cache, in_order, req_ids, table, scale, layout, SM_SCALE)
    assert torch.equal(sparse[0], dense[0][:, 0]) and torch.equal(sparse[1], dense[1][:, 0])

    g = torch.Generator().manual_seed(5)
    padded = torch.cat([in_order, torch.full((len(seq_lens), 5), -1, dtype=torch.int32)], dim=1)
    shuffled = torch.stack([row[torch.randperm(row.shape[0], generator=g)] for row in padded])
    sparse = sparse_mla(q_nope[:, 0], q_pe[:, 0], cache, shuffled, req_ids, table, scale, layout, SM_SCALE)
    torch.testing.assert_close(sparse[0], dense[0][:, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sparse[1], dense[1][:, 0], atol=1e-6, rtol=1e-6)

    key = written_keys(written) if kind.startswith("bf16") else paged_keys(kind, cache, scale, table)
    ref_out, ref_lse = ref_decode(q_nope, q_pe, key, seq_lens, SM_SCALE)
    torch.testing.assert_close(sparse[0].double(), ref_out[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse[1].double(), ref_lse[:, 0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# opcheck, compile


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_opcheck(kind):
    helpers.opcheck(sparse_mla, sparse_args(kind, page_size=4)[0])


def test_compile_matches_eager():
    def step(q_nope, q_pe, cache, topk, req_ids, table):
        out, lse = sparse_mla(q_nope, q_pe, cache, topk, req_ids, table, None, "fp8_ds", SM_SCALE)
        return out * 2, lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for k in (TOPK, 5):
        args = sparse_args("fp8_ds", k=k)[0][:6]
        for got, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# bad input

ARGS = ["q_nope", "q_pe", "kv_cache", "topk_indices", "req_ids", "block_table", "scale", "layout", "softmax_scale"]

BAD = [
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"][0])),  # 2-d
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"].to(torch.int32))),
    ("q_nope", lambda a: a.update(q_nope=a["q_nope"][..., :96], layout="fp8_ds")),  # L % 128
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"][:-1])),  # tokens differ from q_nope
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"][:, :1])),  # heads differ
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"].to(torch.float16))),
    ("q_pe", lambda a: a.update(q_pe=a["q_pe"].to("meta"))),
    ("layout", lambda a: a.update(layout="fp8_e4m3")),
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"][..., 1:])),  # wrong width for layout
    ("kv_cache", lambda a: a.update(layout="fp8_ds")),  # fp8 cache read as fp8_ds
    ("kv_cache", lambda a: a.update(layout="bf16")),  # e4m3 is not a bf16-layout dtype
    ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].to("meta"))),
    ("scale", lambda a: a.update(scale=None)),
    ("scale", lambda a: a.update(scale=a["scale"][None])),
    ("scale", lambda a: a.update(scale=a["scale"].to(torch.bfloat16))),
    ("topk_indices", lambda a: a.update(topk_indices=a["topk_indices"].long())),
    ("topk_indices", lambda a: a.update(topk_indices=a["topk_indices"][0])),  # 1-d
    ("topk_indices", lambda a: a.update(topk_indices=a["topk_indices"][:-1])),  # tokens differ
    ("topk_indices", lambda a: a.update(topk_indices=a["topk_indices"].to("meta"))),
    ("req_ids", lambda a: a.update(req_ids=a["req_ids"].long())),
    ("req_ids", lambda a: a.update(req_ids=a["req_ids"][:-1])),
    ("req_ids", lambda a: a.update(req_ids=a["req_ids"].to("meta"))),
    ("block_table", lambda a: a.update(block_table=a["block_table"].long())),
    ("block_table", lambda a: a.update(block_table=a["block_table"][0])),  # 1-d
    ("block_table", lambda a: a.update(block_table=a["block_table"].to("meta"))),
    ("softmax_scale", lambda a: a.update(softmax_scale=0.0)),
]


@pytest.mark.parametrize("arg,mutate", BAD, ids=[f"{i}-{arg}" for i, (arg, _) in enumerate(BAD)])
def test_bad_input(arg, mutate):
    a = dict(zip(ARGS, sparse_args("fp8", page_size=4)[0]))
    mutate(a)
    assert_value_error(sparse_mla, [a[n] for n in ARGS], arg_error(arg))
