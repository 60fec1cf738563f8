"""The triton backend's csa_indexer_topk (DeepSeek-V4's CSA indexer, run by the V3.2 indexer's
kernels over the compressed keys) against a float64 formula.

A pick is right when it is an entry the token can see, picked once, and no unpicked visible
entry scores higher than the lowest pick (up to rounding: ties in float32 may break either
way); a token that sees fewer entries than topk keeps them all and pads with -1. CPU cases
run Triton's interpreter on tiny shapes; the cuda cases add V4-Flash's indexer (64 heads of 128,
rate 4, top-512, float32 keys, pages of 64) over long contexts, decode and prefill.
"""

from __future__ import annotations

import pytest
import torch

from mlagraph.ops import v4_layouts
from tests.helpers import make_block_table
from tests.ops import test_compressor as ref


def float64_scores(q, w, keys, scale):
    """q [Hi, Di], w [Hi], keys [E, Di] -> [E] sum_h w_h relu(q_h . k) * scale, in float64."""
    return (torch.relu(q.double() @ keys.double().T) * w.double()[:, None]).sum(0) * scale


def check_picks(got, q, w, keys_of, tokens, rate, topk, scale, tol):
    """got [T, topk] against the definition (see the module docstring)."""
    for t, (b, p) in enumerate(tokens):
        visible = (p + 1) // rate
        picks = [i for i in got[t].tolist() if i >= 0]
        assert len(picks) == min(topk, visible) and len(set(picks)) == len(picks), (t, picks)
        assert got[t].tolist().count(-1) == topk - len(picks)
        if not visible:
            continue
        assert all(0 <= i < visible for i in picks), (t, picks, visible)
        scores = float64_scores(q[t], w[t], keys_of(b)[:visible], scale)
        if len(picks) < visible:
            rest = torch.ones(visible, dtype=torch.bool)
            rest[picks] = False
            assert float(scores[picks].min()) >= float(scores[rest].max()) - tol, t


@pytest.mark.parametrize("topk", [1, 3, 40])
@pytest.mark.parametrize("page_size,rate", [(4, 2), (2, 4), (8, 8), (1, 4)])
def test_matches_the_definition(device, topk, page_size, rate):
    q, w, cache, pos, req, table, keys = ref._indexer_setup(page_size, rate)
    cache = torch.nan_to_num(cache)  # unwritten rows are never visible; zeros keep the float64 check simple
    scale = ref.DI**-0.5
    args = [q, w, cache, pos, req, table, page_size, rate, topk, scale]
    got = torch.ops.mlagraph_triton.csa_indexer_topk(*[a.to(device) if isinstance(a, torch.Tensor) else a
                                                        for a in args]).cpu()
    assert got.shape == (len(ref.TOKENS), topk) and got.dtype == torch.int32
    check_picks(got, q, w, lambda b: keys[b], ref.TOKENS, rate, topk, scale, tol=1e-5)
    want = torch.ops.mlagraph.csa_indexer_topk(*args)
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


def test_bfloat16_queries(device):
    q, w, cache, pos, req, table, keys = ref._indexer_setup(4, 2, seed=1)
    cache = torch.nan_to_num(cache)
    args = [q.bfloat16(), w, cache, pos, req, table, 4, 2, 3, 0.5]
    got = torch.ops.mlagraph_triton.csa_indexer_topk(*[a.to(device) if isinstance(a, torch.Tensor) else a
                                                        for a in args]).cpu()
    check_picks(got, q.bfloat16().float(), w, lambda b: keys[b], ref.TOKENS, 2, 3, 0.5, tol=1e-5)


# ---------------------------------------------------------------------------------------------
# V4-Flash's indexer on the H200


def flash_case(seq_lens, tokens, seed=0, page_size=64, rate=4):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 1
    table = make_block_table(seq_lens, page_size, num_pages, seed=seed)
    cache = torch.zeros(num_pages, v4_layouts.entries_per_page(page_size, rate), 128)
    keys = [torch.randn(n // rate, 128, generator=g) for n in seq_lens]
    for b, k in enumerate(keys):
        rows = v4_layouts.entry_slots(table, torch.tensor(b), torch.arange(k.shape[0]), page_size, rate)
        cache.view(-1, 128)[rows] = k
    q = torch.randn(len(tokens), 64, 128, generator=g)
    w = torch.randn(len(tokens), 64, generator=g)
    pos = torch.tensor([p for _, p in tokens])
    req = torch.tensor([b for b, _ in tokens], dtype=torch.int32)
    return q, w, cache, pos, req, table, keys


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_gpu_v4_flash_indexer(phase):
    seq_lens = [8192, 3, 2047, 4100, 600]
    if phase == "decode":
        tokens = [(b, n - 1) for b, n in enumerate(seq_lens)]
    else:  # the last 300 tokens of the long request and all of a short one
        tokens = [(0, p) for p in range(8192 - 300, 8192)] + [(4, p) for p in range(600)]
    q, w, cache, pos, req, table, keys = flash_case(seq_lens, tokens)
    scale = 128**-0.5
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in (q, w, cache, pos, req, table)]
    got = torch.ops.mlagraph_triton.csa_indexer_topk(*args, 64, 4, 512, scale).cpu()
    check_picks(got, q, w, lambda b: keys[b], tokens, 4, 512, scale, tol=1e-3)
