"""The triton backend's indexer ops against the reference ops (mlagraph::indexer_cache_write,
mlagraph::indexer_topk) and a float64 scoring of the same cache.

Cache writes must match the reference writer byte for byte. Top-k picks are compared through
their scores, since the order among (nearly) equal scores is unspecified: every pick is a
distinct visible key, the picks' float64 scores equal the best `n` float64 scores (n = min(topk,
visible keys)) up to float32 rounding, come in descending order, and -1 fills the rest. The
reference op's picks pass the same check. Top-k caches are poisoned (NaN rows, 0xFF bytes) so a
read of a slot that should not be seen picks a NaN. CPU cases run Triton's interpreter on tiny
shapes (Hi=8, D=16); cuda cases use DeepSeek V3.2's Hi=64, D=128, topk=2048 over contexts of
3000-8000 keys in pages of 64.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from mlagraph.ops import layouts
from tests import helpers
from tests.helpers import capture_cuda_graph

ref_write = torch.ops.mlagraph.indexer_cache_write
ref_topk = torch.ops.mlagraph.indexer_topk
tri_write = torch.ops.mlagraph_triton.indexer_cache_write
tri_topk = torch.ops.mlagraph_triton.indexer_topk

# Per device: head dims, top-k, request lengths (request 3 is empty), a hole (a -1 page) in
# request 1 at key position HOLE, and the (request, position) tokens of a mixed batch (prefill
# chunks, decode tokens, tokens seeing fewer than topk keys) and of a decode batch.
SIZES = {
    "cpu": dict(
        D=16, HI=8, topk=6, pages={"single": 1, "paged": 16}, seq_lens=[5, 40, 20, 0], hole=20,
        mixed=[(0, p) for p in range(5)] + [(1, p) for p in (30, 31, 32, 33, 39)] + [(2, 19), (2, 3), (3, 0)],
        decode=[(0, 4), (1, 39), (2, 19), (3, 0)],
    ),
    "cuda": dict(
        D=128, HI=64, topk=2048, pages={"single": 1, "paged": 64}, seq_lens=[3000, 8000, 5100, 0], hole=1000,
        mixed=[(0, 2999)] + [(1, p) for p in range(7990, 8000)] + [(2, p) for p in range(12)]
        + [(2, 3000), (2, 5099), (3, 0), (1, 2047), (1, 2100)],
        decode=[(0, 2999), (1, 7999), (2, 5099), (3, 0)],
    ),
}


def kernels():
    """The kernel module (imported lazily, after conftest has set TRITON_INTERPRET)."""
    return importlib.import_module("mlagraph.ops.triton.indexer")


# ---------------------------------------------------------------------------------------------
# indexer_cache_write


WRITE_CASES = [  # (layout, cache dtype, k dtype)
    ("bf16", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("bf16", torch.float16, torch.float32),
    ("fp8", torch.uint8, torch.float32),
    ("fp8", torch.uint8, torch.bfloat16),
    ("fp8", torch.uint8, torch.float16),
]


def write_case(device, layout, cache_dtype, k_dtype, page_size, num_tokens=None, seed=0):
    """Garbage-filled cache, keys of wildly different magnitudes (an all-zero row: the 1e-10
    scale clamp; tiny entries next to large ones: e4m3 subnormals), shuffled slots with -1s,
    and a non-contiguous k."""
    s = SIZES[device.type]
    d = s["D"]
    num_tokens = num_tokens or (12 if device.type == "cpu" else 300)
    g = torch.Generator().manual_seed(seed)
    num_pages = -(-2 * num_tokens // page_size)
    shape = (num_pages, page_size, layouts.indexer_row_width(layout, d))
    if cache_dtype == torch.uint8:
        cache = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    else:
        cache = torch.randn(shape, generator=g).to(cache_dtype)
    k = torch.randn(num_tokens, d + 3, generator=g) * torch.logspace(-3, 3, num_tokens)[:, None]
    k[:, 1] *= 1e-4
    k[1] = 0.0
    k = k.to(k_dtype)[:, 1 : d + 1]
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[::5] = -1
    return k.to(device), cache.to(device), slots.to(device)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("layout,cache_dtype,k_dtype", WRITE_CASES)
@pytest.mark.parametrize("page_kind", ["single", "paged"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_matches_reference(device, layout, cache_dtype, k_dtype, page_kind, slot_dtype):
    page_size = SIZES[device.type]["pages"][page_kind]
    k, cache, slots = write_case(device, layout, cache_dtype, k_dtype, page_size)
    slots = slots.to(slot_dtype)
    want = cache.cpu()
    ref_write(k.cpu(), want, slots.cpu(), layout)
    assert tri_write(k, cache, slots, layout) is None
    # Bit for bit, including every row the -1 slots must leave alone.
    assert torch.equal(as_bits(cache.cpu()), as_bits(want))


def test_cache_write_many_rows_per_program(device):
    """Rows of one program mixing -1 slots and real ones, the row count not a multiple of it."""
    page_size = SIZES[device.type]["pages"]["paged"]
    k, cache, slots = write_case(device, "fp8", torch.uint8, torch.float32, page_size, num_tokens=37, seed=3)
    want = cache.cpu()
    ref_write(k.cpu(), want, slots.cpu(), "fp8")
    kernels().indexer_cache_write(k, cache, slots, "fp8", config=kernels().IndexerConfig(write_rows=8))
    assert torch.equal(cache.cpu(), want)


def test_cache_write_bad_input():
    k, cache, slots = write_case(torch.device("cpu"), "bf16", torch.float32, torch.float32, 4)
    _, cache8, _ = write_case(torch.device("cpu"), "fp8", torch.uint8, torch.float32, 4)
    cases = [
        ("k", (k[None], cache, slots, "bf16")),
        ("layout", (k, cache, slots, "fp4")),
        ("k_cache", (k, cache[..., :-1], slots, "bf16")),
        ("k_cache", (k, cache8, slots, "bf16")),
        ("slot_mapping", (k, cache, slots[:-1], "bf16")),
    ]
    for arg, args in cases:
        before = args[1].clone()
        helpers.assert_value_error(tri_write, args, helpers.arg_error(arg))
        assert torch.equal(as_bits(args[1]), as_bits(before))


@pytest.mark.parametrize("layout,cache_dtype", [("bf16", torch.bfloat16), ("fp8", torch.uint8)])
def test_cache_write_opcheck(layout, cache_dtype):
    k, cache, slots = write_case(torch.device("cpu"), layout, cache_dtype, torch.float32, 4, num_tokens=5)
    helpers.opcheck(tri_write, (k, cache, slots, layout))


# ---------------------------------------------------------------------------------------------
# indexer_topk


def topk_case(device, layout, cache_dtype, q_dtype, page_kind="paged", batch="mixed", seed=0):
    """Requests of SIZES' lengths written (by the reference writer) into a poisoned cache with
    shuffled pages, a -1 page inside request 1, ties (request 2's first keys are equal), and the
    batch's tokens in shuffled order (so token groups mix requests)."""
    s = SIZES[device.type]
    d, hi, page_size, seq_lens = s["D"], s["HI"], s["pages"][page_kind], s["seq_lens"]
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    table = helpers.make_block_table(seq_lens, page_size, num_pages, seed=seed)
    shape = (num_pages, page_size, layouts.indexer_row_width(layout, d))
    if cache_dtype == torch.uint8:
        cache = torch.full(shape, 255, dtype=torch.uint8)
    else:
        cache = torch.full(shape, math.nan).to(cache_dtype)
    for r, n in enumerate(seq_lens):
        keys = torch.randn(n, d, generator=g)
        if r == 2:
            keys[1:4] = keys[0]
        if n:
            ref_write(keys, cache, torch.tensor(helpers.slots_for(table, page_size, r, range(n))), layout)
    table[1, s["hole"] // page_size] = -1
    tokens = s[batch]
    tokens = [tokens[i] for i in torch.randperm(len(tokens), generator=g).tolist()]
    num_tokens = len(tokens)
    q = torch.randn(num_tokens, hi, d, generator=g).to(q_dtype)
    weights = torch.randn(num_tokens, hi, generator=g) * (hi * d) ** -0.5
    req_ids = torch.tensor([r for r, _ in tokens], dtype=torch.int32)
    positions = torch.tensor([p for _, p in tokens], dtype=torch.int64)
    args = [q, weights, cache, req_ids, positions, table]
    return [a.to(device) for a in args] + [layout, s["topk"]]


def oracle(args):
    """float64 scores [T, S] (-inf where not visible) and, per token, the magnitude of its
    largest score term sum (the scale of float32 rounding errors)."""
    q, weights, cache, req_ids, positions, table, layout, _ = [a.cpu() if torch.is_tensor(a) else a for a in args]
    page_size = cache.shape[1]
    max_len = table.shape[1] * page_size
    slots = layouts.slots_from_block_table(table, page_size, max_len)
    rows = cache.reshape(-1, cache.shape[-1])
    scores, mags = [], []
    for t in range(q.shape[0]):
        sl = slots[int(req_ids[t])]
        keys = layouts.dequantize_index_keys(layout, rows[sl.clamp_min(0)], torch.float64)  # [S, D]
        dots = q[t].double() @ keys.T  # [Hi, S]
        w = weights[t].double()
        visible = (torch.arange(max_len) <= int(positions[t])) & (sl >= 0)
        scores.append(torch.where(visible, w @ dots.relu(), -math.inf))
        mag = (w.abs() @ dots.abs())[visible]
        mags.append(float(mag.max()) if mag.numel() else 0.0)
    return torch.stack(scores), mags


def check_picks(picked: torch.Tensor, scores: torch.Tensor, mags: list[float], topk: int, rtol: float = 1e-4):
    """picked [T, topk]: a valid top-k selection of each row of float64 ``scores``."""
    picked = picked.cpu()
    assert picked.dtype == torch.int32 and picked.shape == (scores.shape[0], topk)
    for t, row in enumerate(scores):
        n = min(topk, int(torch.isfinite(row).sum()))
        got = picked[t].long()
        assert (got[n:] == -1).all(), (t, n, got[n:])
        mine = got[:n]
        assert ((mine >= 0) & (mine < row.numel())).all(), (t, mine)
        assert mine.unique().numel() == n, f"token {t}: repeated picks"
        vals = row[mine]
        assert torch.isfinite(vals).all(), f"token {t}: picked a key it cannot see"
        tol = rtol * mags[t] + 1e-30
        best = row.topk(n).values
        err = (vals.sort(descending=True).values - best).abs().max() if n else 0.0
        assert err <= tol, f"token {t}: picked scores differ from the best by {err} (tol {tol})"
        assert (vals[1:] <= vals[:-1] + tol).all(), f"token {t}: not in descending order"


TOPK_CASES = [  # (layout, cache dtype, q dtype)
    ("bf16", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("bf16", torch.bfloat16, torch.float32),  # mixed dtypes: an exact float32 dot
    ("fp8", torch.uint8, torch.bfloat16),
    ("fp8", torch.uint8, torch.float32),
]


@pytest.mark.parametrize("layout,cache_dtype,q_dtype", TOPK_CASES)
@pytest.mark.parametrize("page_kind", ["single", "paged"])
def test_topk_matches_reference(device, layout, cache_dtype, q_dtype, page_kind):
    args = topk_case(device, layout, cache_dtype, q_dtype, page_kind)
    scores, mags = oracle(args)
    topk = args[-1]
    check_picks(tri_topk(*args), scores, mags, topk)
    check_picks(ref_topk(*[a.cpu() if torch.is_tensor(a) else a for a in args]), scores, mags, topk)


@pytest.mark.parametrize("layout,cache_dtype", [("bf16", torch.bfloat16), ("fp8", torch.uint8)])
def test_topk_decode_batch(device, layout, cache_dtype):
    """One token per request: the BLOCK_T = 1 path (and, with NaN-filled scores, proof that the
    selection reads only columns the scoring kernel wrote)."""
    args = topk_case(device, layout, cache_dtype, torch.bfloat16, batch="decode", seed=1)
    scores, mags = oracle(args)
    check_picks(tri_topk(*args), scores, mags, args[-1])
    poisoned = kernels().IndexerConfig(poison_scores=True)
    check_picks(kernels().indexer_topk(*args, config=poisoned), scores, mags, args[-1])


CONFIGS = [
    dict(block_t=4, block_n=16, splits=3, min_blocks=1),  # groups spanning requests, 3 splits
    dict(block_t=2, block_n=16, splits=2, min_blocks=1, topk_impl="torch"),  # -inf fill, split
    dict(block_t=1, block_n=16, max_tile=16, select_chunk=16),  # streamed selection
    dict(block_t=1, block_n=16, fp16_dots=False),  # fp8 keys -> float32 -> bf16, q's dtype
    dict(block_t=2, block_n=16, splits=2, min_blocks=1, prefetch=True),  # next block in registers
]
GPU_CONFIGS = [
    dict(block_t=4, block_n=64, splits=7, min_blocks=1),
    dict(block_t=2, block_n=128, num_warps=8, topk_impl="torch"),
    dict(block_t=1, block_n=64, num_stages=3, max_tile=4096, select_chunk=2048),
    dict(block_t=1, block_n=128, num_warps=8, num_stages=5, splits=1),
    dict(block_t=1, block_n=64, fp16_dots=False),
    dict(block_t=4, block_n=64, fp16_dots=False),
    dict(block_t=1, block_n=64, prefetch=True),
    dict(block_t=4, block_n=128, num_warps=8, prefetch=True, splits=3),
]


@pytest.mark.parametrize("which", range(max(len(CONFIGS), len(GPU_CONFIGS))))
def test_topk_configs(device, which):
    configs = CONFIGS if device.type == "cpu" else GPU_CONFIGS
    args = topk_case(device, "fp8", torch.uint8, torch.bfloat16, seed=2)
    scores, mags = oracle(args)
    config = kernels().IndexerConfig(**configs[which % len(configs)], poison_scores=True)
    picked = kernels().indexer_topk(*args, config=config)
    check_picks(picked, scores, mags, args[-1])


@pytest.mark.parametrize("q_scale", [2.0 ** -60, 2.0 ** 40])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_topk_fp8_any_q_magnitude(device, q_scale, batch):
    """fp8 keys dot q in fp16 (the default): q is scaled by a power of two into fp16's range, so
    a q far past 65504 or below fp16's smallest normal picks the same keys (bf16 q: the scaling
    is exact)."""
    args = topk_case(device, "fp8", torch.uint8, torch.bfloat16, batch=batch, seed=5)
    args[0] = (args[0].float() * q_scale).to(torch.bfloat16)
    scores, mags = oracle(args)
    check_picks(tri_topk(*args), scores, mags, args[-1])


def test_topk_unaligned_fp8_cache(device):
    """An fp8 cache starting at an odd address: the scales are read byte by byte."""
    args = topk_case(device, "fp8", torch.uint8, torch.bfloat16, batch="decode", seed=3)
    cache = args[2]
    buf = torch.empty(cache.numel() + 1, dtype=torch.uint8, device=device)
    args[2] = buf[1:].view(cache.shape)
    args[2].copy_(cache)
    scores, mags = oracle(args)
    check_picks(tri_topk(*args), scores, mags, args[-1])


def test_topk_more_than_every_key(device):
    """topk beyond the block table's reach (W = topk > S): all visible keys, then -1."""
    args = topk_case(device, "bf16", torch.float32, torch.float32, batch="decode", seed=4)
    args[-1] = args[5].shape[1] * args[2].shape[1] + 5
    scores, mags = oracle(args)
    check_picks(tri_topk(*args), scores, mags, args[-1])


@pytest.mark.parametrize("one_tile", [True, False])
def test_select_kernel_ties_and_padding(device, one_tile):
    """The selection alone on rows with heavy ties, -inf runs, a row of only -inf, a row cut
    short by its position (finite columns past it are not candidates), and rows shorter than
    k: the picked values equal torch.topk's exactly."""
    g = torch.Generator().manual_seed(5)
    shapes = [(50, 12), (50, 57)] if device.type == "cpu" else [(9000, 2048), (1500, 2048)]
    chunk = 16 if device.type == "cpu" else 1024
    cfg = kernels().IndexerConfig(max_tile=1 << 20 if one_tile else chunk, select_chunk=chunk)
    for width, k in shapes:
        scores = torch.randn(4, width, generator=g)
        scores[:, ::3] = -math.inf
        scores[0, : width // 2] = 0.25  # many equal scores around the k-th
        scores[1] = scores[1].round()  # a few distinct values only
        scores[2] = -math.inf
        positions = torch.tensor([width - 1, width + 5, width - 1, width // 4])
        out = torch.empty(4, k, dtype=torch.int32, device=device)
        kernels()._select_triton(scores.to(device), positions.to(device), width, k, out, cfg)
        out = out.cpu()
        for r in range(4):
            row = scores[r, : int(positions[r]) + 1]
            n = min(k, int(torch.isfinite(row).sum()))
            assert (out[r, n:] == -1).all()
            picks = out[r, :n].long()
            assert picks.unique().numel() == n
            assert torch.equal(row[picks], row.topk(n).values)


def test_topk_bad_input():
    args = topk_case(torch.device("cpu"), "bf16", torch.float32, torch.float32)
    q, w, cache, req, pos, table, layout, topk = args

    def with_(**over):
        base = dict(q=q, w=w, cache=cache, req=req, pos=pos, table=table, layout=layout, topk=topk)
        base.update(over)
        return tuple(base.values())

    cases = [
        ("q", with_(q=q[0])),
        ("weights", with_(w=w.to(torch.bfloat16))),
        ("layout", with_(layout="fp8_ds")),
        ("k_cache", with_(cache=cache[..., :-1])),
        ("req_ids", with_(req=req.long())),
        ("positions", with_(pos=pos[1:])),
        ("block_table", with_(table=table.long())),
        ("topk", with_(topk=0)),
    ]
    for arg, bad in cases:
        helpers.assert_value_error(tri_topk, bad, helpers.arg_error(arg))


@pytest.mark.parametrize("layout,cache_dtype", [("bf16", torch.bfloat16), ("fp8", torch.uint8)])
def test_topk_opcheck(layout, cache_dtype):
    args = topk_case(torch.device("cpu"), layout, cache_dtype, torch.bfloat16, batch="decode")
    args[-1] = 4
    helpers.opcheck(tri_topk, tuple(args))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,cache_dtype", [("bf16", torch.bfloat16), ("fp8", torch.uint8)])
def test_cuda_graph_capture(layout, cache_dtype):
    """Cache write + top-k captured in one CUDA graph and replayed with new keys and queries."""
    dev = torch.device("cuda")
    args = topk_case(dev, layout, cache_dtype, torch.bfloat16, batch="decode")
    q, cache = args[0], args[2]
    k, _, _ = write_case(dev, layout, cache_dtype, torch.bfloat16, cache.shape[1], num_tokens=4)
    # Rewrite each decode token's own key (its slot) inside the graph.
    page_size = cache.shape[1]
    table, req_ids, positions = (a.cpu() for a in (args[5], args[3], args[4]))
    slots = [helpers.slots_for(table, page_size, int(r), [int(p)])[0] if int(table[r, 0]) >= 0 else -1
             for r, p in zip(req_ids, positions)]
    slots = torch.tensor(slots, device=dev)

    def step():
        tri_write(k, cache, slots, layout)
        return tri_topk(*args)

    graph, out = capture_cuda_graph(step)

    k.copy_(torch.randn_like(k))
    q.copy_(torch.randn_like(q))
    want_cache = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    tri_write(k, want_cache, slots, layout)
    assert torch.equal(as_bits(cache), as_bits(want_cache))
    scores, mags = oracle(args)
    check_picks(out, scores, mags, args[-1])
