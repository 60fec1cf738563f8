"""mlagraph::indexer_cache_write and mlagraph::indexer_topk against float64 loops and transformers."""

from __future__ import annotations

import pytest
import torch

import mlagraph  # noqa: F401  (registers the ops)
from mlagraph.ops import layouts
from tests import helpers
from tests.helpers import capture_cuda_graph

write_op = torch.ops.mlagraph.indexer_cache_write
topk_op = torch.ops.mlagraph.indexer_topk

D = 16  # index_head_dim (128 in DeepSeek)
HI = 8  # index heads (64 in DeepSeek); enough that relu rarely zeroes a key on every head
PAGE = 4
NUM_PAGES = 12


def random_cache(layout: str, dtype: torch.dtype = torch.float32, num_pages: int = NUM_PAGES, seed: int = 1):
    """A cache full of garbage, so a read of a never-written or masked slot cannot look right."""
    g = torch.Generator().manual_seed(seed)
    width = layouts.indexer_row_width(layout, D)
    if layout == "bf16":
        return torch.randn(num_pages, PAGE, width, generator=g).to(dtype)
    return torch.randint(0, 256, (num_pages, PAGE, width), generator=g, dtype=torch.uint8)


def fp8_row(k: torch.Tensor) -> torch.Tensor:
    """The fp8 layout spelled out: D e4m3 bytes of k / scale, then the float32 scale's 4 bytes."""
    scale = max(k.abs().max().item() / 448.0, 1e-10)
    e4m3 = (k.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([e4m3, torch.tensor([scale], dtype=torch.float32).view(torch.uint8)])


# ---------------------------------------------------------------------------------------------
# indexer_cache_write


def write_case(layout: str, dtype: torch.dtype = torch.float32, k_dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    cache = random_cache(layout, dtype)
    block_table = helpers.make_block_table([5, 7], PAGE, NUM_PAGES)
    slots = helpers.slots_for(block_table, PAGE, 0, [1, 2, 3]) + [-1]
    slots += helpers.slots_for(block_table, PAGE, 1, [5, 6]) + [-1]
    # A non-contiguous k: every other row of a wider tensor.
    k = torch.randn(2 * len(slots), D + 2, dtype=k_dtype)[::2, 1 : D + 1]
    return k, cache, torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize(
    "layout,dtype,k_dtype",
    [
        ("bf16", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("bf16", torch.float16, torch.float32),
        ("fp8", torch.uint8, torch.float32),
        ("fp8", torch.uint8, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_matches_loop(layout, dtype, k_dtype, slot_dtype):
    k, cache, slots = write_case(layout, dtype, k_dtype)
    expected = cache.clone().view(-1, cache.shape[-1])
    for t, slot in enumerate(slots.tolist()):
        if slot == -1:
            continue
        expected[slot] = k[t].to(dtype) if layout == "bf16" else fp8_row(k[t])
    write_op(k, cache, slots.to(slot_dtype), layout)
    # Exact, including every slot that must stay untouched (the -1 tokens write nothing).
    torch.testing.assert_close(cache.view(-1, cache.shape[-1]), expected, rtol=0, atol=0)


def test_cache_write_fp8_round_trip():
    k, cache, slots = write_case("fp8")
    write_op(k, cache, slots, "fp8")
    flat = cache.view(-1, cache.shape[-1])
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            back = layouts.dequantize_index_keys("fp8", flat[slot], torch.float64)
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the row's absmax.
            torch.testing.assert_close(back, k[t].double(), rtol=0, atol=k[t].abs().max().item() / 16)


@pytest.mark.parametrize(
    "layout,dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp8", torch.uint8)]
)
def test_cache_write_opcheck(layout, dtype):
    k, cache, slots = write_case(layout, dtype)
    torch.library.opcheck(write_op, (k, cache, slots, layout))


def _write_error_cases():
    k, cache, slots = write_case("bf16")
    _, cache8, _ = write_case("fp8")
    wide = torch.randn(NUM_PAGES, 2, PAGE, D)
    return [
        ("k", (k[None], cache, slots, "bf16")),
        ("k", (k.to(torch.int32), cache, slots, "bf16")),
        ("layout", (k, cache, slots, "fp16")),
        ("k_cache", (k, cache[..., :-1], slots, "bf16")),  # row width != D
        ("k_cache", (k, cache8, slots, "bf16")),  # uint8 rows are not a bf16-layout cache
        ("k_cache", (k, cache, slots, "fp8")),  # float rows (and width D) are not fp8 rows
        ("k_cache", (k, cache.view(-1, D), slots, "bf16")),  # not [pages, page_size, W]
        ("k_cache", (k, cache.to("meta"), slots, "bf16")),  # another device
        ("k_cache", (k, wide[:, 0], slots, "bf16")),  # pages not back to back
        ("slot_mapping", (k, cache, slots[:-1], "bf16")),
        ("slot_mapping", (k, cache, slots.float(), "bf16")),
        ("slot_mapping", (k, cache, slots.to("meta"), "bf16")),
    ]


@pytest.mark.parametrize("arg,args", _write_error_cases())
def test_cache_write_bad_input(arg, args):
    cache = args[1]
    before = cache.clone()
    helpers.assert_value_error(write_op, args, helpers.arg_error(arg))
    if cache.device.type != "meta":
        torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True)


def test_cache_write_compile_matches_eager():
    k, cache, slots = write_case("fp8")
    eager_cache, compiled_cache = cache.clone(), cache.clone()

    def fn(k, cache, slots):
        write_op(k * 2.0, cache, slots, "fp8")

    fn(k, eager_cache, slots)
    torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)(k, compiled_cache, slots)
    torch.testing.assert_close(compiled_cache, eager_cache, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# indexer_topk


SEQ_LENS = [5, 11, 8]


def topk_case(layout: str, dtype=torch.float32, q_dtype=torch.float32, seed: int = 0):
    """Three requests in one batch: a full prefill (0..4), a chunk after a 6-token prefix (6..10)
    and a decode token (7). Every key of every request is in the cache; the rest is garbage."""
    torch.manual_seed(seed)
    block_table = helpers.make_block_table(SEQ_LENS, PAGE, NUM_PAGES, seed=seed)
    keys = [torch.randn(n, D) for n in SEQ_LENS]
    cache = random_cache(layout, dtype)
    for r, kr in enumerate(keys):
        slots = torch.tensor(helpers.slots_for(block_table, PAGE, r, range(len(kr))))
        write_op(kr, cache, slots, layout)
    req_list = [0] * 5 + [1] * 5 + [2]
    pos_list = list(range(5)) + list(range(6, 11)) + [7]
    t = len(req_list)
    # Non-contiguous q, weights and positions: slices and a transpose.
    q = torch.randn(t, HI, D + 3, dtype=q_dtype)[..., 2 : D + 2]
    weights = torch.randn(HI, t).t()
    positions = torch.tensor(pos_list, dtype=torch.int64).repeat_interleave(2)[::2]
    req_ids = torch.tensor(req_list, dtype=torch.int32)
    return dict(q=q, weights=weights, cache=cache, req_ids=req_ids, positions=positions,
                block_table=block_table, keys=keys)


def loop_scores(q, weights, keys, req_ids, positions, key_dtype):
    """score[t][s] for the visible s of each token, in float64, one token and key at a time."""
    out = []
    for t in range(q.shape[0]):
        kr = keys[int(req_ids[t])].to(key_dtype).double()
        row = []
        for s in range(int(positions[t]) + 1):
            heads = range(q.shape[1])
            row.append(sum(float(weights[t, h]) * max(0.0, float(q[t, h].double() @ kr[s])) for h in heads))
        out.append(row)
    return out


def check_selection(picked: torch.Tensor, scores: list[list[float]], topk: int) -> None:
    for t, row in enumerate(scores):
        got = picked[t].tolist()
        n = min(topk, len(row))
        order = sorted(range(len(row)), key=lambda s: -row[s])
        want = order[:n]
        assert n == len(row) or row[order[n - 1]] > row[order[n]], "the test needs data without ties"
        assert set(got[:n]) == set(want), (t, got, want)
        assert got[n:] == [-1] * (topk - n), (t, got)
        # Documented order: descending score.
        assert all(row[a] >= row[b] for a, b in zip(got[: n - 1], got[1:n])), (t, got)


@pytest.mark.parametrize("topk", [4, 7, 64])  # 64 > P * page_size: padded with -1
@pytest.mark.parametrize(
    "dtype,q_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_topk_matches_loop(topk, dtype, q_dtype, pos_dtype):
    c = topk_case("bf16", dtype, q_dtype)
    picked = topk_op(c["q"], c["weights"], c["cache"], c["req_ids"], c["positions"].to(pos_dtype),
                     c["block_table"], "bf16", topk)
    assert picked.dtype == torch.int32 and picked.shape == (c["q"].shape[0], topk)
    scores = loop_scores(c["q"], c["weights"], c["keys"], c["req_ids"], c["positions"], dtype)
    check_selection(picked, scores, topk)


@pytest.mark.parametrize("topk", [4, 6])
def test_topk_fp8_close_to_bf16(topk):
    c = topk_case("fp8")
    args = (c["q"], c["weights"], c["cache"], c["req_ids"], c["positions"], c["block_table"])
    picked = topk_op(*args, "fp8", topk)
    exact = loop_scores(c["q"], c["weights"], c["keys"], c["req_ids"], c["positions"], torch.float32)
    for t, row in enumerate(exact):
        got = picked[t].tolist()
        n = min(topk, len(row))
        assert got[n:] == [-1] * (topk - n)
        if len(row) <= topk:  # exactness: every visible key, fp8 or not
            assert set(got) - {-1} == set(range(len(row)))
            continue
        # Each fp8 pick scores (exactly) within the fp8 error of the true k-th best score.
        kth = sorted(row, reverse=True)[n - 1]
        tol = 0.1 * max(abs(x) for x in row)
        assert all(row[s] >= kth - tol for s in got), (t, got)


def test_topk_sees_only_its_request_and_pages():
    """Moving request 1 to other pages (same keys) gives the same picks; a wrong page mapping or
    a read across requests would not."""
    c = topk_case("bf16")
    args = (c["q"], c["weights"], c["cache"], c["req_ids"], c["positions"], c["block_table"], "bf16", 5)
    first = topk_op(*args)
    table = c["block_table"].clone()
    free = sorted(set(range(NUM_PAGES)) - set(table.flatten().tolist()))
    cache = c["cache"].clone()
    for i in range(3):
        cache[free[i]] = cache[table[1, i]]
        cache[table[1, i]] = torch.randn(PAGE, D)  # poison the old pages
        table[1, i] = free[i]
    moved = topk_op(c["q"], c["weights"], cache, c["req_ids"], c["positions"], table, "bf16", 5)
    torch.testing.assert_close(moved, first, rtol=0, atol=0)


def test_topk_skips_missing_pages():
    """A position past the request's pages (-1 in the block table) sees no key there, even though
    slot -1 would otherwise read some other row of the cache."""
    c = topk_case("bf16")
    table = helpers.make_block_table([5], PAGE, NUM_PAGES, pad_pages=2)  # 2 pages, then 2 of -1
    picked = topk_op(c["q"][:1], c["weights"][:1], c["cache"], torch.zeros(1, dtype=torch.int32),
                     torch.tensor([15]), table, "bf16", 16)
    assert sorted(picked[0, :8].tolist()) == list(range(8)) and picked[0, 8:].tolist() == [-1] * 8


def test_topk_transformers_formula():
    """DeepseekV32Indexer's math, spelled out in float64 for one request:
    index_scores = (weights_proj(x) * Hi^-0.5) @ relu(q k^T * softmax_scale), causal.
    Folding softmax_scale and Hi^-0.5 into ``weights`` must give the same selection."""
    torch.manual_seed(3)
    seq, topk = 14, 6
    softmax_scale = D**-0.5
    q = torch.randn(seq, HI, D)
    k = torch.randn(seq, D)
    w_raw = torch.randn(seq, HI)  # weights_proj(hidden)
    qd, kd, wd = q.double(), k.double(), w_raw.double()
    scores = torch.relu(torch.einsum("thd,sd->ths", qd, kd) * softmax_scale)  # [S, Hi, S]
    index_scores = torch.einsum("th,ths->ts", wd * HI**-0.5, scores)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    index_scores = index_scores.masked_fill(~causal, float("-inf"))
    hf = index_scores.topk(min(topk, seq), dim=-1).indices
    top = index_scores.topk(topk + 1, dim=-1).values
    assert (top[topk:, topk - 1] > top[topk:, topk]).all(), "the test needs data without ties"

    block_table = helpers.make_block_table([seq], PAGE, NUM_PAGES)
    cache = random_cache("bf16")
    write_op(k, cache, torch.tensor(helpers.slots_for(block_table, PAGE, 0, range(seq))), "bf16")
    weights = w_raw * (HI**-0.5 * softmax_scale)
    ours = topk_op(q, weights, cache, torch.zeros(seq, dtype=torch.int32), torch.arange(seq), block_table,
                   "bf16", topk)
    for t in range(seq):
        # transformers' topk also returns masked (future) positions when t + 1 < topk; we give -1.
        want = {s for s in hf[t].tolist() if s <= t}
        assert set(ours[t].tolist()) - {-1} == want, t


def test_topk_transformers_module():
    """The same through transformers' DeepseekV32Indexer module itself (identity RoPE: cos=1, sin=0)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Config, DeepseekV32Indexer

    torch.manual_seed(4)
    seq, topk, hidden, q_lora = 13, 5, 32, 24
    cfg = DeepseekV32Config(hidden_size=hidden, num_attention_heads=4, q_lora_rank=q_lora, index_n_heads=HI,
                            index_head_dim=D, qk_rope_head_dim=8, index_topk=topk)
    m = DeepseekV32Indexer(cfg, 0)
    x, q_resid = torch.randn(1, seq, hidden), torch.randn(1, seq, q_lora)
    cos, sin = torch.ones(1, seq, 8), torch.zeros(1, seq, 8)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        hf = m(x, q_resid, (cos, sin), causal, None)[0]
        q = m.wq_b(q_resid[0]).view(seq, HI, D)
        k = m.k_norm(m.wk(x[0]))
        weights = m.weights_proj(x[0]).float() * (HI**-0.5 * m.softmax_scale)
    block_table = helpers.make_block_table([seq], PAGE, NUM_PAGES, seed=2)
    cache = random_cache("bf16")
    write_op(k, cache, torch.tensor(helpers.slots_for(block_table, PAGE, 0, range(seq))), "bf16")
    req_ids, positions = torch.zeros(seq, dtype=torch.int32), torch.arange(seq, dtype=torch.int32)
    ours = topk_op(q, weights, cache, req_ids, positions, block_table, "bf16", topk)
    for t in range(seq):
        assert set(ours[t].tolist()) - {-1} == {s for s in hf[t].tolist() if s <= t}, t


@pytest.mark.parametrize(
    "layout,dtype,q_dtype",
    [
        ("bf16", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp8", torch.uint8, torch.bfloat16),
    ],
)
def test_topk_opcheck(layout, dtype, q_dtype):
    c = topk_case(layout, dtype, q_dtype)
    args = (c["q"], c["weights"], c["cache"], c["req_ids"], c["positions"], c["block_table"], layout, 4)
    torch.library.opcheck(topk_op, args)


def _topk_error_cases():
    c = topk_case("bf16")
    q, w, cache, req = c["q"], c["weights"], c["cache"], c["req_ids"]
    pos, bt = c["positions"], c["block_table"]
    cache8 = random_cache("fp8")
    meta = "meta"

    def args(**over):
        base = dict(q=q, w=w, cache=cache, req=req, pos=pos, bt=bt, layout="bf16", topk=4)
        base.update(over)
        return tuple(base.values())

    return [
        ("q", args(q=q[0])),
        ("q", args(q=q.to(torch.float64))),
        ("weights", args(w=w[:, :-1])),
        ("weights", args(w=w.to(torch.bfloat16))),
        ("weights", args(w=w.to(meta))),
        ("layout", args(layout="fp8_ds")),
        ("k_cache", args(cache=cache[..., :-4])),
        ("k_cache", args(cache=cache8)),
        ("k_cache", args(cache=cache, layout="fp8")),
        ("k_cache", args(cache=cache[0])),
        ("k_cache", args(cache=cache.to(meta))),
        ("req_ids", args(req=req[:-1])),
        ("req_ids", args(req=req.long())),
        ("req_ids", args(req=req.to(meta))),
        ("positions", args(pos=pos[1:])),
        ("positions", args(pos=pos.float())),
        ("positions", args(pos=pos.to(meta))),
        ("block_table", args(bt=bt[0])),
        ("block_table", args(bt=bt.long())),
        ("block_table", args(bt=bt.to(meta))),
        ("topk", args(topk=0)),
        ("topk", args(topk=-3)),
    ]


@pytest.mark.parametrize("arg,args", _topk_error_cases())
def test_topk_bad_input(arg, args):
    helpers.assert_value_error(topk_op, args, helpers.arg_error(arg))


def test_topk_compile_matches_eager():
    c = topk_case("fp8", q_dtype=torch.bfloat16)

    def fn(q, weights, cache, req_ids, positions, block_table, topk):
        return topk_op(q, weights * 2.0, cache, req_ids, positions, block_table, "fp8", topk)

    args = (c["q"], c["weights"], c["cache"], c["req_ids"], c["positions"], c["block_table"], 6)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype", [("bf16", torch.bfloat16), ("fp8", torch.uint8)])
def test_cuda_graph_capture(layout, dtype):
    """Cache write + top-k capture in one CUDA graph and replay with new data (no host syncs)."""
    c = topk_case(layout, dtype, torch.bfloat16)
    dev = torch.device("cuda")
    q, weights, cache, req_ids, positions, table = (
        c[n].to(dev) for n in ("q", "weights", "cache", "req_ids", "positions", "block_table")
    )
    k, _, slots = write_case(layout)
    k, slots = k.to(dev), slots.to(dev)

    def step():
        write_op(k, cache, slots, layout)
        return topk_op(q, weights, cache, req_ids, positions, table, layout, 6)

    graph, out = capture_cuda_graph(step)

    k.copy_(torch.randn_like(k))
    q.copy_(torch.randn_like(q))
    want_cache = cache.clone()
    graph.replay()
    write_op(k, want_cache, slots, layout)
    want = topk_op(q, weights, want_cache, req_ids, positions, table, layout, 6)
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
