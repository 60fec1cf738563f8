"""``mha_prefill``: ragged (causal) flash attention over packed requests, with a cached prefix.

Shapes: q [T, H, Dqk], k [S, H, Dqk], v [S, H, Dv] (DeepSeek: Dqk = 192 = 128 nope + 64 rope,
Dv = 128), cu_seqlens_q / cu_seqlens_k [B+1] int32. Request b owns queries
[cu_q[b], cu_q[b+1]) and keys [cu_k[b], cu_k[b+1]); with a prefix its queries line up with the
END of its keys, so query i sees keys j <= i + (len_k - len_q).

Grid: (cdiv(T, BLOCK_M) + B, H), fixed from shapes. Request b's query tiles are numbered from
f(b) = cu_q[b] // BLOCK_M + b, which strictly increases with b and leaves room for
cdiv(len_q, BLOCK_M) tiles before f(b + 1); so a program finds its (request, tile) by a binary
search over f on the device (no host sync, no scratch), and surplus programs exit. The queries
past cu_q[B] (padding) form a pseudo-request B with no keys, so their out 0 / lse -inf is
written by the same code. Programs run heaviest tile first (the last tiles of a causal request
see the most keys) and with the tile index fastest, so the programs running together share one
head's K/V in L2.

Each program runs the usual online softmax in base 2 (scores pre-multiplied by
softmax_scale·log2(e), exp2) with float32 accumulators: first over the key blocks every row of
the tile sees (no masks at all), then over the few blocks on the causal diagonal / past the end
of the keys (masked, with -inf guards so a row that sees nothing ends with out 0, lse -inf).
The q.k dot is split into a power-of-two part and a remainder (192 = 128 + 64) because
``tl.arange`` extents must be powers of two; tiny test dims are padded to 16 with masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._hardware import hardware, interpreted
from ._launch import check_runnable
from ._tl import dot as _dot

LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptr, row_stride, rows, row_ok, cols, NCOLS: tl.constexpr, BLOCK_C: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """[len(rows), BLOCK_C] tile of a row-major matrix (unit column stride); masked loads only
    where needed (a tile whose rows are all valid and whose width is exact loads unmasked)."""
    ptrs = ptr + rows[:, None] * row_stride + cols[None, :]
    if MASK_ROWS:
        if BLOCK_C == NCOLS:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < NCOLS), other=0.0)
    else:
        if BLOCK_C == NCOLS:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < NCOLS, other=0.0)
    return x


@triton.jit
def _scores(q1, q2, k_base, stride_kt, offs_n, k_ok, d1, d2, D1: tl.constexpr, D2: tl.constexpr,
            B_D1: tl.constexpr, B_D2: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    """q [BLOCK_M, Dqk] . k [BLOCK_N, Dqk]^T as two dots (power-of-two part + remainder)."""
    k1 = _load_tile(k_base, stride_kt, offs_n, k_ok, d1, D1, B_D1, MASK)
    s = _dot(q1, tl.trans(k1), tl.zeros([q1.shape[0], k1.shape[0]], tl.float32), PRECISION, UPCAST)
    if D2 > 0:
        k2 = _load_tile(k_base + D1, stride_kt, offs_n, k_ok, d2, D2, B_D2, MASK)
        s = _dot(q2, tl.trans(k2), s, PRECISION, UPCAST)
    return s


@triton.jit
def _mha_prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, out_ptr, lse_ptr,
    num_tokens, num_keys, num_reqs, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    B_D1: tl.constexpr, B_D2: tl.constexpr, B_DV: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Heaviest tiles first: reverse the flat tile order.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)

    # Largest b in [0, num_reqs] with f(b) = cu_q[b] // BLOCK_M + b <= pid (f(0) = 0 <= pid).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= pid
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    req = lo
    real = req < num_reqs  # else: the padding rows past cu_q[B], which see no key
    q_start = tl.load(cu_q_ptr + req)
    q_end = tl.minimum(tl.where(real, tl.load(cu_q_ptr + req + 1, mask=real, other=0), num_tokens), num_tokens)
    k_start = tl.load(cu_k_ptr + req, mask=real, other=0)
    k_end = tl.minimum(tl.load(cu_k_ptr + req + 1, mask=real, other=0), num_keys)
    len_q = q_end - q_start
    len_k = tl.maximum(k_end - k_start, 0)
    m0 = (pid - (q_start // BLOCK_M + req)) * BLOCK_M  # first query of this tile, within its request
    if m0 >= len_q:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d1 = tl.arange(0, B_D1)
    d2 = tl.arange(0, B_D2)
    dv = tl.arange(0, B_DV)
    row_ok = offs_m < len_q

    q_base = q_ptr + q_start.to(tl.int64) * stride_qt + head * stride_qh
    q1 = _load_tile(q_base, stride_qt, offs_m, row_ok, d1, D1, B_D1, True)
    q2 = q1
    if D2 > 0:
        q2 = _load_tile(q_base + D1, stride_qt, offs_m, row_ok, d2, D2, B_D2, True)
    k_head = k_ptr + k_start.to(tl.int64) * stride_kt + head * stride_kh
    v_head = v_ptr + k_start.to(tl.int64) * stride_vt + head * stride_vh

    # Key blocks [0, full_end) are visible to every row of the tile; [full_end, end) need masks.
    if CAUSAL:
        shift = len_k - len_q  # query i sees keys j <= i + shift
        full_end = tl.maximum(m0 + shift + 1, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(len_k, tl.minimum(m0 + BLOCK_M, len_q) + shift)
    else:
        shift = 0
        full_end = len_k // BLOCK_N * BLOCK_N
        end = len_k

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, B_DV], tl.float32)

    # Block pointers advance by BLOCK_N rows a step (64-bit pointers: no int32 overflow).
    k_base = k_head
    v_base = v_head
    for start_n in range(0, full_end, BLOCK_N):
        s = _scores(q1, q2, k_base, stride_kt, offs_n, offs_n, d1, d2, D1, D2, B_D1, B_D2, False, PRECISION, UPCAST)
        s = s * qk_scale
        # Every row has a finite score here, so m_new is finite: no guard needed.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, stride_vt, offs_n, offs_n, dv, DV, B_DV, False)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
        k_base += BLOCK_N * stride_kt
        v_base += BLOCK_N * stride_vt

    k_base = k_head + full_end.to(tl.int64) * stride_kt
    v_base = v_head + full_end.to(tl.int64) * stride_vt
    for start_n in range(full_end, end, BLOCK_N):
        key = start_n + offs_n
        k_ok = key < len_k
        s = _scores(q1, q2, k_base, stride_kt, offs_n, k_ok, d1, d2, D1, D2, B_D1, B_D2, True, PRECISION, UPCAST)
        seen = k_ok[None, :]
        if CAUSAL:
            seen = seen & (key[None, :] <= offs_m[:, None] + shift)
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, stride_vt, offs_n, k_ok, dv, DV, B_DV, True)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
        k_base += BLOCK_N * stride_kt
        v_base += BLOCK_N * stride_vt

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    # m + log2(l) is log2(sum exp); times ln 2 it is the natural log.
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    rows = q_start.to(tl.int64) + offs_m
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(lse_ptr + rows * stride_lt + head, lse, mask=row_ok)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _split_head_dim(dqk: int) -> tuple[int, int]:
    """Dqk -> (power-of-two part, remainder): 192 -> (128, 64); at most 16 -> (Dqk, 0)."""
    if dqk <= 16:
        return dqk, 0
    d1 = 1 << (dqk.bit_length() - 1)
    return d1, dqk - d1


# Shared memory left to Triton's own scratch (layout conversions, the softmax's reductions)
# beside the Q tile and the K/V stages: 47 KB, which leaves 180 KB of an H200's 227 KB.
_SMEM_RESERVE = 47 * 1024


def _stage_budget(device: torch.device) -> int:
    return hardware(device).shared_memory_per_block - _SMEM_RESERVE


def prefill_config(q: torch.Tensor, v: torch.Tensor) -> dict:
    """The default launch config, from shapes and dtypes only.

    Hopper, 16-bit inputs: 128 x 64 tiles, 8 warps (two warpgroups for wgmma on the 128 rows),
    3 pipeline stages while Q plus three K/V stages fit in the stage budget (180 KB on an H200;
    Dqk 192, Dv 128: 48 KB + 3 x 40 KB), else 2. float32 runs exact ("ieee") dots on smaller tiles. The
    CPU interpreter uses 16 x 16 tiles so tiny test shapes cross tile and diagonal boundaries.
    """
    if interpreted(_mha_prefill_kernel):
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if q.dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # larger tiles spill
    block_m, block_n = 128, 64
    d1, d2 = _split_head_dim(q.shape[2])
    dqk = _pow2(d1) + (_pow2(d2) if d2 else 0)
    smem = lambda stages: 2 * (block_m * dqk + stages * block_n * (dqk + _pow2(v.shape[2])))  # noqa: E731
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8, "num_stages": 3 if smem(3) <= _stage_budget(q.device) else 2}


def mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request=False,
                config: dict | None = None):
    """Same arguments and results as ``torch.ops.mlagraph.mha_prefill`` (checked by the caller);
    ``config`` overrides :func:`prefill_config` (keys BLOCK_M, BLOCK_N, num_warps, num_stages).

    ``single_request`` (one causal request, T == S: the backend's ``dense_prefill_sdpa``
    capability) runs cuDNN's fused attention for 16-bit CUDA inputs, which measured 1.2-1.3x
    faster than this kernel on the H200 at N = 2048..8192; everything else, and every ragged or
    prefix batch, runs the Triton kernel. The choice depends only on the flag, dtype and device.
    """
    if single_request and q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return sdpa_prefill(q, k, v, softmax_scale)
    check_runnable("mha_prefill", _mha_prefill_kernel, q)
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[2]
    out = torch.empty((num_tokens, num_heads, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    # The kernel addresses the last dim with unit stride.
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    cfg = {**prefill_config(q, v), **(config or {})}
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_reqs = cu_seqlens_q.shape[0] - 1
    d1, d2 = _split_head_dim(dqk)
    grid = (triton.cdiv(num_tokens, block_m) + num_reqs, num_heads)
    _mha_prefill_kernel[grid](
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse,
        num_tokens, k.shape[0], num_reqs, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        D1=d1, D2=d2, DV=dv, B_D1=_pow2(d1), B_D2=_pow2(d2) if d2 else 16, B_DV=_pow2(dv),
        CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_mha_prefill_kernel),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float):
    """ONE request, no prefix, causal, through cuDNN's fused attention (the benchmark's peer).

    q, k [N, H, Dqk], v [N, H, Dv] -> (out [N, H, Dv] in q's dtype, lse [N, H] float32, natural
    log). ``F.scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` dispatches to
    ``aten._scaled_dot_product_cudnn_attention`` but drops its logsumexp, so this calls that op
    directly with compute_log_sumexp=True. Its lse comes back as [1, H, N] or (torch >= 2.9)
    [1, H, N, 1]; the reshape takes either.
    """
    n, num_heads, _ = q.shape
    # [N, H, D] -> [1, H, N, D] views: the BSHD layout cuDNN takes without a copy.
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qb, kb, vb, None, True, 0.0, True, False, scale=float(softmax_scale)
    )
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1).contiguous(), lse.reshape(num_heads, n).t().contiguous().float()

