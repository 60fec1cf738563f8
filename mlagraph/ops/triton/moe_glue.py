"""The grouped MoE path's glue in two launches: :func:`silu_mul` between the grouped GEMMs and
:func:`unsort_combine` after them (the generic :mod:`mlagraph.ops.moe` functions of those names
are the oracles: the same roundings, in the same order).

In torch each is a chain over [T*k, 2I] / [T*k, D] float32 tensors: gate_up's copy to float32,
silu, the product, the copy back; then y's copy to float32, the index_copy back to (token, slot)
order, the product with the weights and the sum. At a 4K-token V2-Lite prefill those kernels
took about 20 ms of the 72 ms on the H200 (2026-12-04, benchmarks/profile_prefill.py), as much
as its grouped GEMMs: each moves the activations through memory in float32 once more. Here
each reads its input once in the GEMM's dtype and writes its output once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._hardware import interpreted
from ._launch import check_runnable


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, act_ptr, I, stride_g, stride_u, stride_a, BLOCK: tl.constexpr):
    """Row r, columns [c*BLOCK, (c+1)*BLOCK): act = silu(gate) * up in float32, rounded."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(gate_ptr + r * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + r * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + r * stride_a + cols, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _unsort_combine_kernel(y_ptr, row_of_ptr, weights_ptr, remote_ptr, shared_ptr, out_ptr, D, first_expert,
                           num_local, stride_y, stride_s, stride_o, TOP_K: tl.constexpr,
                           ROWS_IN_ORDER: tl.constexpr, REMOTE: tl.constexpr, SHARED_ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Token t, columns [c*BLOCK_D, ...): out[t] = sum over slots j, in order, of
    weight[t, j] * y[row of pair t*k + j] in float32, rounded to out's dtype. The row is
    row_of[pair], or the pair itself (ROWS_IN_ORDER: the pair kernels' y). A pair of another
    rank's expert adds nothing: REMOTE 0 none are, 1 remote[pair] != 0 says so, 2 its expert
    id (remote_ptr: the ids) is outside first_expert .. first_expert + num_local - 1.
    SHARED_ROWS > 0: plus the shared experts, the float32 sum of rows t*SHARED_ROWS ..
    of shared_ptr rounded to out's dtype, added in it (as the model's routed + shared)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):
        p = t * TOP_K + j
        if ROWS_IN_ORDER:
            row = p.to(tl.int64)
        else:
            row = tl.load(row_of_ptr + p).to(tl.int64)
        w = tl.load(weights_ptr + p)
        here = True
        if REMOTE == 1:  # another rank's row holds whatever the GEMM left there: never read it
            here = tl.load(remote_ptr + p) == 0
        elif REMOTE == 2:
            e = tl.load(remote_ptr + p).to(tl.int32) - first_expert
            here = (e >= 0) & (e < num_local)
        if here:
            acc += w * tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    if SHARED_ROWS > 0:
        shared = tl.zeros([BLOCK_D], tl.float32)
        for c in tl.static_range(SHARED_ROWS):
            row = (t * SHARED_ROWS + c).to(tl.int64)
            shared += tl.load(shared_ptr + row * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
        acc = acc.to(out_dtype).to(tl.float32) + shared.to(out_dtype).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_dtype), mask=ok)


def _block(n: int, kernel) -> int:
    """Columns a program: the whole row up to 1024 (V2-Lite's I=1408 takes two); small on CPU."""
    return 32 if interpreted(kernel) else min(1024, max(16, triton.next_power_of_2(n)))


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gate_up [rows, 2I] -> silu(gate) * up [rows, I] in dtype (float32 math)."""
    inter = gate_up.shape[1] // 2
    return silu_mul_apart(gate_up[:, :inter], gate_up[:, inter:], dtype)


def silu_mul_apart(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gate, up [rows, I] -> silu(gate) * up [rows, I] in dtype (float32 math), one launch."""
    check_runnable("moe", _silu_mul_kernel, gate)
    rows, inter = gate.shape
    act = torch.empty(rows, inter, dtype=dtype, device=gate.device)
    if rows == 0 or inter == 0:
        return act
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    block = _block(inter, _silu_mul_kernel)
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate, up, act, inter, gate.stride(0), up.stride(0), act.stride(0), BLOCK=block, num_warps=4)
    return act


def unsort_combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, remote, dtype) -> torch.Tensor:
    """y [T*k, D] in sorted-row order (row i is pair ``order[i]``), weights [T, k] -> [T, D] in
    dtype: the float32 weighted sum of each token's k rows; ``remote`` [T*k] bool or None."""
    check_runnable("moe", _unsort_combine_kernel, y)
    # row_of[pair] = its sorted row: order's inverse permutation (a scatter of T*k ints).
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return combine_rows(y, row_of, weights, remote, dtype)


def combine_rows(y: torch.Tensor, row_of: torch.Tensor | None, weights: torch.Tensor, remote, dtype,
                 expert_ids: torch.Tensor | None = None, first_expert: int = 0, num_local: int = 0,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`unsort_combine` with each pair's row of y given: row_of [T*k] (pair -> row), or
    None where y's rows are the pairs in order (the pair kernels' output). Pairs another rank
    computes add nothing: ``remote`` [T*k] bool / uint8 marks them, or ``expert_ids`` [T*k] with
    this rank's ``first_expert`` and ``num_local`` tells them; neither: every pair is here.
    ``shared``: None, or the shared experts' output as [T * c, D] rows (c per token, summed in
    float32, rounded to dtype) added to the routed sum in dtype."""
    check_runnable("moe", _unsort_combine_kernel, y)
    num_tokens, top_k = weights.shape
    dim = y.shape[1]
    out = torch.empty(num_tokens, dim, dtype=dtype, device=y.device)
    if num_tokens == 0 or dim == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    flat_w = weights.reshape(-1).float().contiguous()
    if remote is not None:
        mode, marks = 1, remote.reshape(-1).to(torch.uint8)
    elif expert_ids is not None:
        mode, marks = 2, expert_ids.reshape(-1).contiguous()
    else:
        mode, marks = 0, flat_w
    shared_rows = 0
    if shared is not None:
        shared = shared if shared.stride(1) == 1 else shared.contiguous()
        shared_rows = shared.shape[0] // num_tokens
    block = _block(dim, _unsort_combine_kernel)
    _unsort_combine_kernel[(num_tokens, triton.cdiv(dim, block))](
        y, flat_w if row_of is None else row_of, flat_w, marks, y if shared is None else shared, out, dim,
        first_expert, num_local, y.stride(0), 0 if shared is None else shared.stride(0), out.stride(0),
        TOP_K=top_k, ROWS_IN_ORDER=row_of is None, REMOTE=mode, SHARED_ROWS=shared_rows, BLOCK_D=block,
        num_warps=4)
    return out
