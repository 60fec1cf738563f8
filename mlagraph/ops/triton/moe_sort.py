"""The MoE's (token, slot) pairs sorted by expert, and the grouped GEMMs' tile schedule, in one
launch (three for a prefill).

The generic op (:func:`mlagraph.ops.moe._grouped_experts`) sorts with torch: int16 keys, a radix
argsort, a scatter-add histogram, a cumsum, the row gather, and per GEMM the tile schedule
(:func:`.grouped_fp8.tile_schedule`: a dozen more small kernels). At decode sizes each of those
is a launch of a few microseconds that moves a few hundred bytes: about forty of them a MoE
layer, about 100 us on an H100, a third of the time reading a V2-Lite layer's experts takes at
batch 32 (benchmarks/kernels.py --only moe, 2026-12-06).

Here one program does all of it for up to :data:`ONE_PROGRAM_MAX_PAIRS` pairs (a counting sort:
a batch has few pairs and an expert id is a small integer):

1. counts[e]: the pairs of each local expert (under expert parallelism bin ``num_local``
   collects another rank's pairs, so they sort after every local group, as in the generic op);
2. starts = the exclusive prefix sum of counts: each group's first sorted row;
3. each pair's sorted row = starts[e] + the pairs of expert e before it (a stable sort: pair
   order within a group, as ``argsort(stable=True)`` gives), by chunks of pairs: a one-hot
   [CHUNK, E_PAD] of the chunk's experts and its prefix sum down the chunk;
4. the tiles: an expert with c rows takes ceil(c / BLOCK_M) tiles of BLOCK_M rows that never
   straddle two experts; tile t belongs to the expert whose tile range holds t (a search over
   the prefix sum of tile counts); tiles past the last real one get expert ``num_local``, which
   the GEMM kernel skips.

One program's work grows with the pairs, so a prefill's pairs go in blocks of
:data:`BLOCK_PAIRS` through three launches: step 1 per block (a program each), then one program
sums the blocks' counts, takes step 2 and turns each block's counts into the first row each
expert has in that block (the group's start plus that expert's pairs in the blocks before it),
and builds the tiles; then step 3 per block, from those first rows. The result is the same.

Outputs: ``order`` [P] int32 (sorted row -> pair), ``row_of`` [P] int32 (pair -> sorted row),
``remote`` [P] uint8 (1 for another rank's pairs, whose rows no GEMM writes), ``group_end``
[num_local] int32 (each expert's end row: ``F.grouped_mm``'s ``offs``), and per tile
``tile_expert`` / ``tile_row0`` / ``tile_row_end`` [max_tiles] int32 with max_tiles =
cdiv(P, BLOCK_M) + min(E, P), the same contract as :func:`.grouped_fp8.tile_schedule` (which
stays the oracle). Nothing is read on the host: capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._hardware import interpreted
from ._launch import check_runnable

# Up to this many pairs one program sorts the whole batch (one launch: decode and mid-sized
# batches, where launches cost more than the work). Past it (prefill) the pairs are cut in
# blocks of BLOCK_PAIRS, each counted by a program of its own, one small program turns the
# blocks' counts into each block's first row per expert (and the tiles), and a program per block
# places its pairs: three launches whose work spreads over the GPU.
ONE_PROGRAM_MAX_PAIRS = 4096
BLOCK_PAIRS = 2048


@triton.jit
def _bins_of(ids_ptr, offs, P, first_expert, num_local):
    """Local expert of each pair in ``offs`` (another rank's pairs: bin num_local), and which exist."""
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32) - first_expert
    e = tl.where((e >= 0) & (e < num_local), e, num_local)
    return e, ok


@triton.jit
def _count_bins(ids_ptr, lo, hi, first_expert, num_local, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs lo..hi-1 per bin: [E_PAD] int32."""
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(lo, hi, CHUNK):
        e, ok = _bins_of(ids_ptr, c0 + tl.arange(0, CHUNK), hi, first_expert, num_local)
        counts += tl.sum(((e[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32), 0)
    return counts


@triton.jit
def _place_pairs(ids_ptr, order_ptr, row_of_ptr, remote_ptr, lo, hi, seen, first_expert, num_local,
                 E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Sorted rows of pairs lo..hi-1, ``seen`` [E_PAD] the first row each bin has left: a
    pair's row is that plus the same-bin pairs before it (a stable sort)."""
    bins = tl.arange(0, E_PAD)
    for c0 in range(lo, hi, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e, ok = _bins_of(ids_ptr, offs, hi, first_expert, num_local)
        onehot = ((e[:, None] == bins[None, :]) & ok[:, None]).to(tl.int32)  # [CHUNK, E_PAD]
        before = tl.cumsum(onehot, 0) - onehot  # same-bin pairs earlier in this chunk
        row = tl.sum(onehot * (before + seen[None, :]), 1)  # [CHUNK]
        tl.store(row_of_ptr + offs, row, mask=ok)
        tl.store(order_ptr + row, offs, mask=ok)
        tl.store(remote_ptr + offs, (e == num_local).to(tl.uint8), mask=ok)
        seen += tl.sum(onehot, 0)


@triton.jit
def _write_tiles(counts, starts, num_local, max_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                 group_end_ptr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each local group's end row, and tiles of BLOCK_M rows, none straddling two experts; bin
    num_local (remote) gets none."""
    bins = tl.arange(0, E_PAD)
    tl.store(group_end_ptr + bins, starts + counts, mask=bins < num_local)
    tiles = tl.where(bins < num_local, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    for t0 in range(0, max_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        # the first bin whose tiles end after t; none (past the last tile): E_PAD -> num_local
        expert = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)
        mine = bins[None, :] == expert[:, None]  # [CHUNK, E_PAD], one hot (or none past the end)
        row0 = tl.sum(tl.where(mine, starts[None, :] - tile_start[None, :] * BLOCK_M, 0), 1) + t * BLOCK_M
        row_end = tl.sum(tl.where(mine, starts[None, :] + counts[None, :], 0), 1)
        ok = t < max_tiles
        tl.store(tile_expert_ptr + t, tl.minimum(expert, num_local), mask=ok)
        tl.store(tile_row0_ptr + t, row0, mask=ok)
        tl.store(tile_row_end_ptr + t, row_end, mask=ok)


@triton.jit
def _sort_pairs_kernel(
    ids_ptr, order_ptr, row_of_ptr, remote_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, group_end_ptr,
    P, first_expert, num_local, max_tiles,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The whole batch in one program: count, prefix sum, place, tiles."""
    counts = _count_bins(ids_ptr, 0, P, first_expert, num_local, E_PAD, CHUNK)
    starts = tl.cumsum(counts, 0) - counts  # each group's first row
    _place_pairs(ids_ptr, order_ptr, row_of_ptr, remote_ptr, 0, P, starts, first_expert, num_local, E_PAD, CHUNK)
    _write_tiles(counts, starts, num_local, max_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                 group_end_ptr, E_PAD, CHUNK, BLOCK_M)


@triton.jit
def _block_count_kernel(ids_ptr, block_bins_ptr, P, first_expert, num_local,
                        BLOCK_PAIRS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Blocked sort, 1/3: block b's pairs per bin -> block_bins[b]."""
    b = tl.program_id(0)
    lo = b * BLOCK_PAIRS
    counts = _count_bins(ids_ptr, lo, tl.minimum(lo + BLOCK_PAIRS, P), first_expert, num_local, E_PAD, CHUNK)
    tl.store(block_bins_ptr + b * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _block_starts_kernel(block_bins_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, group_end_ptr,
                         num_blocks, num_local, max_tiles,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Blocked sort, 2/3 (one program): the groups' sizes and first rows, then in place of each
    block's counts the first row each bin has in that block (its group's start plus the
    same-bin pairs of the blocks before it); and the tiles."""
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for b in range(0, num_blocks):
        counts += tl.load(block_bins_ptr + b * E_PAD + bins)
    starts = tl.cumsum(counts, 0) - counts
    seen = starts
    for b in range(0, num_blocks):
        mine = tl.load(block_bins_ptr + b * E_PAD + bins)
        tl.store(block_bins_ptr + b * E_PAD + bins, seen)
        seen += mine
    _write_tiles(counts, starts, num_local, max_tiles, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr,
                 group_end_ptr, E_PAD, CHUNK, BLOCK_M)


@triton.jit
def _block_place_kernel(ids_ptr, order_ptr, row_of_ptr, remote_ptr, block_bins_ptr, P, first_expert, num_local,
                        BLOCK_PAIRS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Blocked sort, 3/3: block b's pairs to their rows, from the first rows kernel 2 left."""
    b = tl.program_id(0)
    lo = b * BLOCK_PAIRS
    seen = tl.load(block_bins_ptr + b * E_PAD + tl.arange(0, E_PAD))
    _place_pairs(ids_ptr, order_ptr, row_of_ptr, remote_ptr, lo, tl.minimum(lo + BLOCK_PAIRS, P), seen,
                 first_expert, num_local, E_PAD, CHUNK)


@dataclasses.dataclass(frozen=True)
class SortedPairs:
    """A batch's pairs sorted by expert: ``order`` [P] (sorted row -> pair t*k + j), ``row_of``
    [P] (pair -> sorted row), ``remote`` [P] uint8 (another rank's expert), ``group_end``
    [num_local] int32 (each local expert's end row: the ``offs`` of ``F.grouped_mm``), and the
    grouped GEMMs' tiles of ``block_m`` rows (``tile_expert`` num_local past the last tile),
    each [max_tiles] int32; none (empty) when ``block_m`` is None."""

    order: torch.Tensor
    row_of: torch.Tensor
    remote: torch.Tensor
    group_end: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row_end: torch.Tensor
    block_m: int | None

    @property
    def schedule(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tile_expert, self.tile_row0, self.tile_row_end


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the schedule has room for: each expert's last tile may be partial."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def sort_pairs(ids: torch.Tensor, num_local: int, block_m: int | None, first_expert: int | None = None,
               block_pairs: int | None = None) -> SortedPairs:
    """ids [T, k] global expert ids -> :class:`SortedPairs` for this rank's ``num_local``
    experts from ``first_expert`` (None: all of them, from 0). Up to
    :data:`ONE_PROGRAM_MAX_PAIRS` pairs in one launch, past it in blocks of ``block_pairs``
    (default :data:`BLOCK_PAIRS`; a power of two >= 16; given, it forces the blocked sort)."""
    check_runnable("moe", _sort_pairs_kernel, ids)
    if block_pairs is not None and (not isinstance(block_pairs, int) or block_pairs < 16
                                    or block_pairs & (block_pairs - 1)):
        raise ValueError(f"mlagraph_triton.moe sort_pairs: block_pairs: expected a power of two >= 16, "
                         f"got {block_pairs!r}")
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    # block_m None: no tile schedule (GEMMs that take the group ends, as F.grouped_mm does)
    tiles = 0 if block_m is None else max_tiles(num_pairs, num_local, block_m)
    tile_rows = 1 if block_m is None else block_m  # a tile height the kernels take; no tile is written
    dev = ids.device
    order = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    row_of = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    remote = torch.empty(num_pairs, dtype=torch.uint8, device=dev)
    # group ends, then the three tile rows, in one allocation
    ints = torch.empty(num_local + 3 * tiles, dtype=torch.int32, device=dev)
    group_end, tile = ints[:num_local], ints[num_local:].view(3, tiles)
    out = SortedPairs(order, row_of, remote, group_end, tile[0], tile[1], tile[2], block_m)
    if not num_pairs:
        group_end.zero_()  # every group empty; there are no tiles
        return out
    # expert parallel: one bin past the local ones for another rank's pairs (route gives
    # only valid ids, so a whole layer's batch needs none)
    e_pad = triton.next_power_of_2(num_local + (first_expert is not None))
    # a [CHUNK, E_PAD] one-hot a step: 16K lanes over 8 warps, fewer on CPU (the interpreter)
    chunk = 16 if interpreted(_sort_pairs_kernel) else max(16, min(256, 16384 // e_pad))
    first = 0 if first_expert is None else first_expert
    if block_pairs is None and num_pairs <= ONE_PROGRAM_MAX_PAIRS:
        _sort_pairs_kernel[(1,)](
            flat, order, row_of, remote, tile[0], tile[1], tile[2], group_end, num_pairs, first, num_local, tiles,
            E_PAD=e_pad, CHUNK=chunk, BLOCK_M=tile_rows, num_warps=8,
        )
        return out
    block_pairs = block_pairs or BLOCK_PAIRS
    num_blocks = triton.cdiv(num_pairs, block_pairs)
    block_bins = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=dev)
    _block_count_kernel[(num_blocks,)](flat, block_bins, num_pairs, first, num_local,
                                       BLOCK_PAIRS=block_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    _block_starts_kernel[(1,)](block_bins, tile[0], tile[1], tile[2], group_end, num_blocks, num_local, tiles,
                               E_PAD=e_pad, CHUNK=chunk, BLOCK_M=tile_rows, num_warps=8)
    _block_place_kernel[(num_blocks,)](flat, order, row_of, remote, block_bins, num_pairs, first, num_local,
                                       BLOCK_PAIRS=block_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    return out
