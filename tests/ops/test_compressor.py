"""compressor_update and csa_indexer_topk against float64 formulas, in one call and in chunks."""

from __future__ import annotations

import pytest
import torch

from mlagraph.ops import rope_cos_sin_cache, v4_layouts
from tests import helpers
from tests.helpers import arg_error, assert_value_error, make_block_table

W, R = 8, 4  # entry width, rope dims (the last R of each entry)
EPS = 1e-6
SEQ_LENS = [9, 16, 3]
NUM_PAGES = 40
BASE = 10000.0


def _inputs(overlap: bool, rate: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c = 2 if overlap else 1
    kv = [torch.randn(n, c * W, generator=g) for n in SEQ_LENS]
    gate = [torch.randn(n, c * W, generator=g) for n in SEQ_LENS]
    bias = torch.randn(rate, c * W, generator=g)
    norm_w = torch.rand(W, generator=g) + 0.5
    return kv, gate, bias, norm_w


def ref_entries(kv, gate, bias, norm_w, rate, overlap, rope_dim=R):
    """float64 entries [n // rate, W] of one request, straight from the definition (W from
    ``norm_w``, RoPE with base 10000 on the last ``rope_dim`` features)."""
    n, W, R = kv.shape[0], norm_w.numel(), rope_dim
    kv, gate = kv.double(), gate.double() + bias.double()[torch.arange(n) % rate]
    inv_freq = 1.0 / BASE ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    out = []
    for i in range(n // rate):
        own = range(i * rate, (i + 1) * rate)
        if overlap:  # Ca halves of the previous window, Cb halves of this one
            prev = range((i - 1) * rate, i * rate) if i > 0 else range(0)
            vals = [kv[j, :W] for j in prev] + [kv[j, W:] for j in own]
            gates = [gate[j, :W] for j in prev] + [gate[j, W:] for j in own]
        else:
            vals, gates = [kv[j] for j in own], [gate[j] for j in own]
        p = torch.softmax(torch.stack(gates), dim=0)
        e = (p * torch.stack(vals)).sum(0)
        e = e / torch.sqrt(e.pow(2).mean() + EPS) * norm_w.double()
        ang = i * rate * inv_freq
        a, b = e[W - R :: 2].clone(), e[W - R + 1 :: 2].clone()
        e[W - R :: 2], e[W - R + 1 :: 2] = a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()
        out.append(e)
    return torch.stack(out) if out else torch.zeros(0, W, dtype=torch.float64)


def _caches(page_size, rate, overlap):
    c = 2 if overlap else 1
    state = torch.full((NUM_PAGES, page_size, 2 * c * W), float("nan"))
    rows = v4_layouts.entries_per_page(page_size, rate)
    return state, torch.full((NUM_PAGES, rows, W), float("nan"))


def run_chunks(page_size, rate, overlap, chunks, seed=0):
    """Feeds every request's tokens in steps of ``chunks`` tokens (all requests in each step)."""
    kv, gate, bias, norm_w = _inputs(overlap, rate, seed)
    table = make_block_table(SEQ_LENS, page_size, NUM_PAGES, seed=seed)
    state, comp = _caches(page_size, rate, overlap)
    cos_sin = rope_cos_sin_cache(R, 64, BASE)
    done = [0] * len(SEQ_LENS)
    while any(d < n for d, n in zip(done, SEQ_LENS)):
        rows = []  # (request, position), requests interleaved in reverse to make the batch ragged
        for b in reversed(range(len(SEQ_LENS))):
            take = min(chunks, SEQ_LENS[b] - done[b])
            rows += [(b, p) for p in range(done[b], done[b] + take)]
            done[b] += take
        pos = torch.tensor([p for _, p in rows])
        req = torch.tensor([b for b, _ in rows], dtype=torch.int32)
        slots = torch.tensor([helpers.slots_for(table, page_size, b, [p])[0] for b, p in rows])
        torch.ops.mlagraph.compressor_update(
            torch.stack([kv[b][p] for b, p in rows]), torch.stack([gate[b][p] for b, p in rows]), bias, norm_w,
            cos_sin, pos, req, slots, table, state, comp, rate, overlap, EPS)
    return (kv, gate, bias, norm_w), table, state, comp


def _entry(comp, table, page_size, rate, b, i):
    slot = v4_layouts.entry_slots(table, torch.tensor(b), torch.tensor(i), page_size, rate)
    return comp.view(-1, W)[slot]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size,rate", [(4, 2), (4, 4), (2, 4), (8, 2)])
@pytest.mark.parametrize("chunks", [100, 3, 1])
def test_entries_match_float64_in_one_call_or_chunks(overlap, page_size, rate, chunks):
    (kv, gate, bias, norm_w), table, state, comp = run_chunks(page_size, rate, overlap, chunks)
    for b, n in enumerate(SEQ_LENS):
        want = ref_entries(kv[b], gate[b], bias, norm_w, rate, overlap)
        for i in range(n // rate):
            torch.testing.assert_close(_entry(comp, table, page_size, rate, b, i).double(), want[i],
                                       atol=1e-5, rtol=1e-5)
        if n % rate:  # the open window wrote no entry (still NaN)
            assert torch.isnan(_entry(comp, table, page_size, rate, b, n // rate)).all()
        for p in range(n):  # the state row: kv | gate + position bias
            row = state.view(-1, state.shape[-1])[helpers.slots_for(table, page_size, b, [p])[0]]
            torch.testing.assert_close(row, torch.cat([kv[b][p], gate[b][p] + bias[p % rate]]))


def test_opcheck_and_no_host_sync():
    page_size, rate = 4, 2
    kv, gate, bias, norm_w = _inputs(True, rate)
    table = make_block_table(SEQ_LENS, page_size, NUM_PAGES)
    state = torch.zeros(NUM_PAGES, page_size, 4 * W)
    comp = torch.zeros(NUM_PAGES, 2, W)
    n = SEQ_LENS[1]
    args = (kv[1], gate[1], bias, norm_w, rope_cos_sin_cache(R, 64, BASE), torch.arange(n),
            torch.ones(n, dtype=torch.int32), torch.tensor(helpers.slots_for(table, page_size, 1, range(n))), table,
            state, comp, rate, True, EPS)
    helpers.opcheck(torch.ops.mlagraph.compressor_update, args)
    with helpers.NoHostSync() as mode:
        torch.ops.mlagraph.compressor_update(*args)
    assert "mlagraph::compressor_update" in mode.ops_seen


def _compressor_args(**over):
    rate, page_size = 2, 4
    kv, gate, bias, norm_w = _inputs(True, rate)
    table = make_block_table(SEQ_LENS, page_size, NUM_PAGES)
    args = dict(kv=kv[0], gate=gate[0], position_bias=bias, norm_weight=norm_w,
                cos_sin_cache=rope_cos_sin_cache(R, 64, BASE), positions=torch.arange(9),
                req_ids=torch.zeros(9, dtype=torch.int32), slot_mapping=torch.arange(9), block_table=table,
                state_cache=torch.zeros(NUM_PAGES, page_size, 4 * W), compressed_cache=torch.zeros(NUM_PAGES, 2, W),
                compress_rate=rate, overlap=True, eps=EPS)
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize("arg,bad", [
    ("kv", torch.zeros(9, 2 * W + 1)),
    ("gate", torch.zeros(8, 2 * W)),
    ("position_bias", torch.zeros(3, 2 * W)),
    ("norm_weight", torch.zeros(2 * W)),
    ("cos_sin_cache", torch.zeros(64, 3)),
    ("positions", torch.zeros(9)),
    ("slot_mapping", torch.zeros(9, dtype=torch.int32)),
    ("state_cache", torch.zeros(NUM_PAGES, 4, 2 * W)),
    ("state_cache", torch.zeros(NUM_PAGES, 4, 4 * W, dtype=torch.bfloat16)),
    ("compressed_cache", torch.zeros(NUM_PAGES, 4, W)),
    ("compress_rate", 3),  # neither a divisor nor a multiple of page size 4
    ("eps", 0.0),
])
def test_compressor_bad_inputs(arg, bad):
    over = {arg: bad}
    if arg == "compress_rate":
        over["position_bias"] = torch.zeros(3, 2 * W)  # consistent with the rate, so the rate is what fails
    assert_value_error(torch.ops.mlagraph.compressor_update, _compressor_args(**over), arg_error(arg))


# ---------------------------------------------------------------------------------------------
# csa_indexer_topk

HI, DI = 3, 8
TOKENS = [(0, 8), (1, 15), (1, 2), (1, 9), (2, 0), (0, 3)]


def _indexer_setup(page_size=4, rate=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = make_block_table(SEQ_LENS, page_size, NUM_PAGES, seed=seed)
    cache = torch.full((NUM_PAGES, v4_layouts.entries_per_page(page_size, rate), DI), float("nan"))
    keys = [torch.randn(n // rate, DI, generator=g) for n in SEQ_LENS]
    for b, k in enumerate(keys):
        for i in range(k.shape[0]):
            cache.view(-1, DI)[v4_layouts.entry_slots(table, torch.tensor(b), torch.tensor(i), page_size, rate)] = k[i]
    q = torch.randn(len(TOKENS), HI, DI, generator=g)
    w = torch.randn(len(TOKENS), HI, generator=g)
    pos = torch.tensor([p for _, p in TOKENS])
    req = torch.tensor([b for b, _ in TOKENS], dtype=torch.int32)
    return q, w, cache, pos, req, table, keys


@pytest.mark.parametrize("topk", [1, 3, 40])
@pytest.mark.parametrize("page_size,rate", [(4, 2), (2, 4)])
def test_indexer_keeps_the_best_visible_entries(topk, page_size, rate):
    q, w, cache, pos, req, table, keys = _indexer_setup(page_size, rate)
    scale = DI**-0.5
    got = torch.ops.mlagraph.csa_indexer_topk(q, w, cache, pos, req, table, page_size, rate, topk, scale)
    assert got.shape == (len(TOKENS), topk) and got.dtype == torch.int32
    for t, (b, p) in enumerate(TOKENS):
        visible = (p + 1) // rate
        scores = [sum(float(w[t, h]) * max(float(q[t, h].double() @ keys[b][i].double()), 0.0) * scale
                      for h in range(HI)) for i in range(visible)]
        best = sorted(range(visible), key=lambda i: -scores[i])[:topk]
        picked = [i for i in got[t].tolist() if i >= 0]
        assert sorted(picked) == sorted(best)
        assert got[t].tolist().count(-1) == topk - len(best)


def test_indexer_opcheck_and_errors():
    q, w, cache, pos, req, table, _ = _indexer_setup()
    args = [q, w, torch.nan_to_num(cache), pos, req, table, 4, 2, 3, 0.5]
    helpers.opcheck(torch.ops.mlagraph.csa_indexer_topk, tuple(args))
    for i, arg, bad in [(0, "q", q[0]), (1, "weights", w.double()), (2, "index_cache", cache[:, :1]),
                        (6, "page_size", 0), (7, "compress_rate", 3), (8, "topk", 0), (9, "softmax_scale", 0.0)]:
        bad_args = list(args)
        bad_args[i] = bad
        assert_value_error(torch.ops.mlagraph.csa_indexer_topk, bad_args, arg_error(arg))
