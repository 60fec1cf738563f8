"""Triton kernels for the paged-batch glue the library backends need (:mod:`mlagraph.ops._paged`).

Each replaces a chain of small torch ops that a library call pays per layer:

- ``flat_slots_padded``: FlashMLA's sparse kernels take flat cache slots (page * page_size +
  offset), -1 for none, in index lists padded to a block multiple, and our contract wants
  out 0 for a token with no key at all. The torch form is a dozen elementwise kernels over
  [T, K] int64 (clamp, divide, gather, modulo, where, pad, all); this is one pass that reads
  the positions once and writes the int32 slots and the per-token "no key" flag.
- ``mask_empty``: out = 0 and lse = -inf for the tokens (or requests) with no key, and lse
  -inf where FlashMLA reports a keyless query as +inf. The torch form is four kernels, one of
  them a ``masked_fill_`` that reads and writes the whole output (537 MB for a 4096-token
  sparse prefill at H=128); this is one launch that reads one flag per row, writes only the
  rows of out that have none, and rewrites the small lse. A decode layer pays it per call, so
  it is what stands between a library kernel and its time inside our op.

Both have fixed grids (one program per row) and read no value on the host: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_runnable


@triton.jit
def _flat_slots_kernel(
    block_table, positions, rows, out, empty,
    stride_bt_b, stride_bt_p, stride_pos_t, stride_pos_k, stride_out_t,
    K, K_PAD, NUM_COLS,
    PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.load(rows + t).to(tl.int64)
    bt_row = block_table + r * stride_bt_b
    max_len = NUM_COLS * PAGE
    seen = tl.zeros([BLOCK], tl.int32)
    for k0 in range(0, K_PAD, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        pos = tl.load(positions + t * stride_pos_t + k * stride_pos_k, mask=k < K, other=-1).to(tl.int64)
        ok = (pos >= 0) & (pos < max_len)
        page = tl.load(bt_row + tl.where(ok, pos // PAGE, 0) * stride_bt_p, mask=ok, other=-1).to(tl.int64)
        ok = ok & (page >= 0)
        slot = tl.where(ok, page * PAGE + pos % PAGE, -1)
        tl.store(out + t * stride_out_t + k, slot.to(tl.int32), mask=k < K_PAD)
        seen += ok.to(tl.int32)
    tl.store(empty + t, tl.sum(seen, 0) == 0)


def flat_slots_padded(block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, page_size: int,
                      multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T, K] (-1 = none) of request ``rows`` [T] -> (slots [T, K'] int32, -1 where
    none, K' = K rounded up to ``multiple``; empty [T] bool: the token has no key at all).
    Equal to ``pad_last(flat_slots(...), multiple)`` and ``(slots < 0).all(1)``."""
    check_runnable("flat_slots", _flat_slots_kernel, positions, namespace="mlagraph.ops._paged")
    tokens, k = positions.shape
    k_pad = -(-k // multiple) * multiple
    out = torch.empty((tokens, k_pad), dtype=torch.int32, device=positions.device)
    empty = torch.empty((tokens,), dtype=torch.bool, device=positions.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(max(k_pad, 16)))  # k_pad 0: the loop is empty, all empty
        _flat_slots_kernel[(tokens,)](
            block_table, positions, rows.contiguous(), out, empty,
            block_table.stride(0), block_table.stride(1), positions.stride(0), positions.stride(1), out.stride(0),
            k, k_pad, block_table.shape[1], PAGE=page_size, BLOCK=block, num_warps=4,
        )
    return out, empty


@triton.jit
def _mask_empty_kernel(
    out, lse, lse_out, empty, stride_out_row, stride_l0, stride_l1, stride_l2, A, B,
    ROW: tl.constexpr, BLOCK: tl.constexpr, LSE_BLOCK: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    e = tl.load(empty + n)
    if e:
        for c0 in range(0, ROW, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(out + n * stride_out_row + c, tl.zeros([BLOCK], out.dtype.element_ty), mask=c < ROW)
    for i0 in range(0, A * B, LSE_BLOCK):
        i = i0 + tl.arange(0, LSE_BLOCK)
        ok = i < A * B
        v = tl.load(lse + n * stride_l0 + (i // B) * stride_l1 + (i % B) * stride_l2, mask=ok, other=0.0)
        v = tl.where(e | (v == float("inf")), float("-inf"), v)
        tl.store(lse_out + n * A * B + i, v, mask=ok)


def mask_empty(out: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor):
    """out [N, ...] (each row contiguous), lse [N, ...] float32 (any strides, at most 3 dims),
    empty [N] bool -> (out with out[n] = 0 where empty[n], in place; a new contiguous lse with
    -inf where empty[n] or +inf). One launch. Returns None, touching nothing, when out's rows
    are not contiguous or lse has more than 3 dims: the caller runs the torch form."""
    check_runnable("mask_empty", _mask_empty_kernel, out, namespace="mlagraph.ops._paged")
    n = out.shape[0]
    if n == 0:
        return out, lse.clone()
    if not out[0].is_contiguous() or lse.dim() > 3:
        return None
    row = out[0].numel()
    lse3 = lse.view(*lse.shape, *([1] * (3 - lse.dim())))  # [N, A, B]: size-1 dims added, strides kept
    _, a, b = lse3.shape
    lse_out = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
    _mask_empty_kernel[(n,)](
        out, lse3, lse_out, empty.contiguous(), out.stride(0), *lse3.stride(), a, b,
        ROW=row, BLOCK=max(16, min(4096, triton.next_power_of_2(row))),
        LSE_BLOCK=max(16, min(1024, triton.next_power_of_2(a * b))), num_warps=4,
    )
    return out, lse_out
