"""mlagraph/ops/triton/moe_sort.py: the one-launch sort of a MoE batch's (token, slot) pairs and
the grouped GEMMs' tile schedule, against torch's stable argsort and the torch tile schedule
(grouped_fp8.tile_schedule); then the sorted path built on it (CPU through Triton's interpreter;
CUDA under -m gpu)."""

from __future__ import annotations

import pytest
import torch

import mlagraph.ops.triton  # noqa: F401  (registers mlagraph_triton.*)
from mlagraph.ops.moe import moe_all_experts, route
from mlagraph.ops.triton import moe as triton_moe
from mlagraph.ops.triton.grouped_fp8 import tile_schedule
from mlagraph.ops.triton.moe_sort import ONE_PROGRAM_MAX_PAIRS, max_tiles, sort_pairs
from tests.helpers import NoHostSync, capture_cuda_graph
from tests.ops.test_moe import FP8_D, FP8_I, ROUTINGS, random_moe_args


def _routes(num_tokens: int, top_k: int, num_experts: int, seed: int, skew: bool = False) -> torch.Tensor:
    """[T, k] distinct expert ids per token; ``skew``: most tokens pick the same few experts
    (groups of many rows: several tiles an expert)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if skew:
        scores[:, :top_k] += 1.0
    return scores.topk(top_k, dim=1).indices


def _oracle(ids: torch.Tensor, num_local: int, block_m: int, first_expert: int | None):
    """The generic op's sort (torch) and the torch tile schedule."""
    flat = ids.reshape(-1) - (first_expert or 0)
    remote = (flat < 0) | (flat >= num_local)
    keys = flat.masked_fill(remote, num_local)
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_local, dtype=torch.long).scatter_add_(0, keys[~remote], torch.ones_like(keys[~remote]))
    return order, remote, tile_schedule(counts.cumsum(0).int(), flat.numel(), block_m)


SORT_CASES = [
    (1, 1, 4, 16, False),      # one pair
    (5, 3, 8, 16, False),      # fewer pairs than a chunk
    (40, 3, 8, 16, True),      # several chunks, several tiles an expert
    (33, 6, 64, 16, False),    # V2-Lite's router width, padded bins
    (21, 4, 12, 4, True),      # experts not a power of two, small tiles
    (9, 8, 256, 64, False),    # V3's router width, most experts empty
]


def _check_sort(got, ids, local, block_m, first):
    order, remote, (expert, row0, row_end) = _oracle(ids, local, block_m, first)
    assert torch.equal(got.order.cpu().long(), order)  # stable: pair order within a group
    assert torch.equal(got.row_of.cpu().long()[order], torch.arange(order.numel()))
    assert torch.equal(got.remote.cpu().bool(), remote)
    keys = ids.reshape(-1) - (first or 0)
    counts = torch.stack([(keys == e).sum() for e in range(local)]) if local else torch.zeros(0)
    assert torch.equal(got.group_end.cpu().long(), counts.cumsum(0))  # F.grouped_mm's offs
    tiles = max_tiles(ids.numel(), local, block_m)
    assert got.tile_expert.shape == (tiles,) == expert.shape
    real = expert < local
    assert torch.equal(got.tile_expert.cpu(), torch.where(real, expert, local))  # past the end: local
    assert torch.equal(got.tile_row0.cpu()[real], row0[real])
    assert torch.equal(got.tile_row_end.cpu()[real], row_end[real])


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,skew", SORT_CASES)
@pytest.mark.parametrize("ranks", [1, 2])
def test_sort_and_schedule_equal_torch(device, num_tokens, top_k, num_experts, block_m, skew, ranks):
    ids = _routes(num_tokens, top_k, num_experts, seed=num_tokens, skew=skew)
    local = num_experts // ranks
    first = None if ranks == 1 else local  # the second rank's shard
    _check_sort(sort_pairs(ids.to(device), local, block_m, first), ids, local, block_m, first)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,skew", SORT_CASES[2:])
@pytest.mark.parametrize("ranks", [1, 2])
def test_blocked_sort_equals_torch(device, num_tokens, top_k, num_experts, block_m, skew, ranks):
    """The prefill form (counts per block, the blocks' first rows, placement per block), forced
    at small sizes with 16 or 32 pairs a block: several blocks, a last one partly filled."""
    ids = _routes(num_tokens, top_k, num_experts, seed=num_tokens, skew=skew)
    local = num_experts // ranks
    first = None if ranks == 1 else local
    for block_pairs in (16, 32):
        _check_sort(sort_pairs(ids.to(device), local, block_m, first, block_pairs=block_pairs), ids, local,
                    block_m, first)


@pytest.mark.parametrize("block_pairs", [None, 16])
def test_no_tile_schedule_without_block_m(device, block_pairs):
    """block_m None (the prefill path: F.grouped_mm takes the group ends): the same sort and group
    ends, and no tiles made."""
    ids = _routes(40, 3, 8, seed=40, skew=True)
    got = sort_pairs(ids.to(device), 8, None, block_pairs=block_pairs)
    want = sort_pairs(ids.to(device), 8, 16, block_pairs=block_pairs)
    for name in ("order", "row_of", "remote", "group_end"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.block_m is None and all(t.numel() == 0 for t in got.schedule)


def test_no_pairs(device):
    got = sort_pairs(torch.zeros(0, 6, dtype=torch.long, device=device), 64, 16)
    assert got.order.numel() == 0 and got.tile_expert.numel() == 0
    assert torch.equal(got.group_end.cpu(), torch.zeros(64, dtype=torch.int32))


def test_past_one_program_the_sort_is_blocked(device):
    """A prefill's pairs (more than ONE_PROGRAM_MAX_PAIRS) take the blocked sort by default."""
    ids = _routes(ONE_PROGRAM_MAX_PAIRS // 2 + 3, 2, 8, seed=3)
    _check_sort(sort_pairs(ids.to(device), 8, 64), ids, 8, 64, None)


@pytest.mark.parametrize("block_pairs", [0, 8, 24, 16.0])
def test_bad_block_pairs(block_pairs):
    with pytest.raises(ValueError, match=rf"block_pairs: expected a power of two >= 16, got {block_pairs!r}"):
        sort_pairs(torch.zeros(4, 2, dtype=torch.long), 8, 16, block_pairs=block_pairs)


def test_sort_reads_nothing_on_the_host(device):
    ids = _routes(12, 3, 8, seed=1).to(device)
    sort_pairs(ids, 8, 16)  # compile first
    with NoHostSync():
        sort_pairs(ids, 8, 16)


def test_blocked_sort_reads_nothing_on_the_host(device):
    ids = _routes(12, 3, 8, seed=1).to(device)
    sort_pairs(ids, 8, 16, block_pairs=16)  # compile first
    with NoHostSync():
        sort_pairs(ids, 8, 16, block_pairs=16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(2048, 8, 256), (1024, 6, 64), (4096, 6, 64)])
@pytest.mark.parametrize("ranks", [1, 8])
def test_prefill_sizes_sort_like_torch(num_tokens, top_k, num_experts, ranks):
    """Prefill batches (V3 at 2K tokens: 16K pairs; V2-Lite at 1K and 4K) on the GPU: the
    blocked sort, in BLOCK_PAIRS blocks, against torch; an expert shard's too."""
    ids = _routes(num_tokens, top_k, num_experts, seed=num_tokens, skew=True)
    local = num_experts // ranks
    first = None if ranks == 1 else 3 * local
    _check_sort(sort_pairs(ids.cuda(), local, 64, first), ids, local, 64, first)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("num_tokens", [3, 12, 40])
def test_sorted_path_matches_the_oracle(device, num_tokens, fp8):
    """The sorted path (sort, gathered gate_up GEMM, silu * up, down GEMM, combine) on float and
    fp8 experts, whatever path the op itself would take at this size."""
    args = random_moe_args(num_tokens, 8, FP8_D, FP8_I, ROUTINGS[3], fp8=fp8)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    weights, ids = route(args[1], *args[4:12])
    scales = args[12:14] if fp8 else (None, None)
    got = triton_moe.grouped_triton(args[0], weights, ids, args[2], args[3], None, *scales)
    want = moe_all_experts(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [32, 256])
def test_v3_dims_on_the_sorted_path(num_tokens, fp8, whole_gpu_memory):
    """DeepSeek-V3's MoE layer at T = 32 (1 pair an expert) and 256 (8 an expert: the sorted
    path's largest), the op (whichever path) and the sorted path forced, against the oracle."""
    from benchmarks.common import V3_MOE, moe_layer_args

    args = moe_layer_args(num_tokens, device="cuda", fp8=fp8, **V3_MOE)
    want = moe_all_experts(*args)
    weights, ids = route(args[1], *args[4:12])
    scales = args[12:14] if fp8 else (None, None)
    sorted_path = triton_moe.grouped_triton(args[0], weights, ids, args[2], args[3], None, *scales)
    for out in (torch.ops.mlagraph_triton.moe(*args), sorted_path):
        rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert out.dtype == torch.bfloat16 and rel < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sorted_path_captures_in_a_cuda_graph(fp8):
    """Captured once, replayed on new tokens and routes (other groups, other tiles): equal to an
    eager call."""
    args = random_moe_args(24, 8, FP8_D, FP8_I, ROUTINGS[3], torch.bfloat16, fp8=fp8)
    args = tuple(a.to("cuda") if isinstance(a, torch.Tensor) else a for a in args)
    scales = args[12:14] if fp8 else (None, None)

    def fn():
        return triton_moe.grouped_triton(args[0], *route(args[1], *args[4:12]), args[2], args[3], None, *scales)

    graph, out = capture_cuda_graph(fn)
    args[0].copy_(torch.randn_like(args[0]))
    args[1].copy_(torch.randn_like(args[1]))
    graph.replay()
    torch.testing.assert_close(out, fn(), rtol=0, atol=0)


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_Q": 16}, r"unknown keys \['BLOCK_Q'\]"),
    ({"BLOCK_M": 24}, "BLOCK_M must be a power of two >= 16, got 24"),
    ({"BLOCK_N": 8}, "BLOCK_N must be a power of two >= 16, got 8"),
])
def test_bad_tile_overrides_name_the_key(config, match):
    args = random_moe_args(3, 8, FP8_D, FP8_I, ROUTINGS[3])
    with pytest.raises(ValueError, match=match):
        triton_moe.grouped_triton(args[0], *route(args[1], *args[4:12]), args[2], args[3], config=config)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_the_torch_sorted_peer_equals_the_sorted_path(device, fp8):
    """benchmarks' peer for the one-launch sort (the torch sort feeding the same grouped GEMM,
    ``--moe-sort torch``) computes the same layer."""
    from benchmarks.common import torch_sorted_experts

    args = random_moe_args(12, 8, FP8_D, FP8_I, ROUTINGS[3], fp8=fp8)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    weights, ids = route(args[1], *args[4:12])
    scales = args[12:14] if fp8 else (None, None)
    want = triton_moe.grouped_triton(args[0], weights, ids, args[2], args[3], None, *scales)
    got = torch_sorted_experts(args[0], weights, ids, args[2], args[3], None, *scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
