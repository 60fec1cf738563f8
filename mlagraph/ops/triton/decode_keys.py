"""Triton ``mla_decode``, keys-major form: for the memory-bound row counts (H * s_q <= 32), float
caches ("bf16"); the fp8 caches' variant, which reads the latent in byte chunks, is
:mod:`.decode_keys_fp8`.

Same math, splits, masks and outputs as :mod:`.decode`'s rows-major ``_split_kernel`` (read its
docstring first); what differs is the orientation of the two products. With few query rows
(H=16 at s_q 1 or 2, a TP shard's heads) the rows-major form has M = 16-32 rows per MMA, under
Hopper's 64-row wgmma, so it runs on the older mma.sync path. Here the keys are the M side:

    sT   [BLOCK_N, BLOCK_H] = kv [BLOCK_N, L] @ qnT [L, BLOCK_H]  +  pe @ qpT   (keys x rows)
    accT [L, BLOCK_H]      += kv^T [L, BLOCK_N] @ pT [BLOCK_N, BLOCK_H]

64 keys fill a wgmma's M; the rows (16, 24, 32, ...) are its N, which only needs multiples of 8,
so no row is padded to 64 the way FlashMLA's and FlashInfer's kernels pad a shard's heads. Both
products read the key tile from shared memory, the softmax runs down the key axis (axis 0).

Loads. ``TMA``: a split's whole blocks of BLOCK_N keys each lie in one page (the launcher asks
page_size % BLOCK_N == 0 and pages laid out back to back), so each is one box of BLOCK_N
contiguous cache rows, copied by the Hopper copy engine (no address registers, no per-row
masks); a -1 page is put at a negative row, which the engine reads as zeros, and its keys are
masked out of the scores. A split's last, partial block is gathered with masks after the loop
(rows past the length read as 0, never as the cache's stale bytes). Without ``TMA`` every block
is gathered with masks, as in the rows-major form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_tiles import (_block_rows, _dot, _load_latent, _load_rope, _normalizer, _query_rows, _score_scales,
                            _split_run)


@triton.jit
def _copy_tile(lat_desc, pe_desc, row0, L: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """BLOCK_N cache rows from row ``row0`` through the copy engine -> (kv [BLOCK_N, L], pe [BLOCK_N, R])."""
    return lat_desc.load([row0, 0]).to(DOT_DTYPE), pe_desc.load([row0, L]).to(DOT_DTYPE)


@triton.jit
def _attend(kv, pe, qnT, qpT, visible, scale, m_i, l_i, accT, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
            DOT_DTYPE: tl.constexpr, F32: tl.constexpr):
    """One block of keys into the online softmax (base 2), keys-major: visible [BLOCK_N, BLOCK_H]."""
    sT = _dot(pe, qpT, tl.zeros([BLOCK_N, BLOCK_H], tl.float32), F32)
    sT = _dot(kv, qnT, sT, F32) * scale
    sT = tl.where(visible, sT, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sT, 0))
    # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(sT - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    accT = _dot(tl.trans(kv), p.to(DOT_DTYPE), accT * alpha[None, :], F32)
    return m_new, l_i, accT


@triton.jit
def _split_keys_kernel(
    q_nope, q_pe, cache, lat_desc, pe_desc, block_table, seq_lens, fp8_scale, out, lse,
    qk_scale,  # softmax_scale * log2(e)
    stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
    stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
    stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
    MAX_LEN,
    S_Q: tl.constexpr, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BL: tl.constexpr, BR: tl.constexpr,
    LAYOUT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr, F32: tl.constexpr, FP16: tl.constexpr,
    TMA: tl.constexpr,  # whole blocks through the descriptors (L == BL, R == BR; see the module docstring)
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    DOT_DTYPE: tl.constexpr = tl.float32 if F32 else (tl.float16 if FP16 else q_nope.dtype.element_ty)

    seq_len, lo, hi = _split_run(seq_lens, b, stride_sl, MAX_LEN, split, BLOCK_N, MAX_SPLITS)
    offs_m, row_ok, qi, qh, limit = _query_rows(row_block, seq_len, S_Q, H, BLOCK_H)
    offs_l = tl.arange(0, BL)
    offs_r = tl.arange(0, BR)
    # The queries transposed, [BL, BLOCK_H] and [BR, BLOCK_H]: the products' shared-memory B side.
    qnT = tl.load(q_nope + b * stride_qn_b + (qi * stride_qn_s + qh * stride_qn_h)[None, :] + offs_l[:, None],
                  mask=row_ok[None, :] & (offs_l[:, None] < L), other=0.0).to(DOT_DTYPE)
    qpT = tl.load(q_pe + b * stride_qp_b + (qi * stride_qp_s + qh * stride_qp_h)[None, :] + offs_r[:, None],
                  mask=row_ok[None, :] & (offs_r[:, None] < R), other=0.0).to(DOT_DTYPE)

    scale, out_scale = _score_scales(fp8_scale, qk_scale, LAYOUT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    accT = tl.zeros([BL, BLOCK_H], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table + b * stride_bt_b
    gather_lo = lo
    if TMA:
        gather_lo = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)  # the partial block's start
        for start in range(lo, gather_lo, BLOCK_N):
            page = tl.load(bt_row + (start // PAGE) * stride_bt_p)
            kv, pe = _copy_tile(lat_desc, pe_desc, page * PAGE + start % PAGE, L, DOT_DTYPE)
            visible = (page >= 0) & ((start + offs_n)[:, None] <= limit[None, :])
            m_i, l_i, accT = _attend(kv, pe, qnT, qpT, visible, scale, m_i, l_i, accT, BLOCK_N, BLOCK_H,
                                     DOT_DTYPE, F32)
    # With TMA only the partial block is gathered, in 16-key pieces, so its registers do not set
    # the kernel's. sm_90 builds with the H200's Triton 3.6 (benchmarks/sm90_build.py), BLOCK_N
    # 64: a whole gathered [64, L] tile spills 192 B at 16 rows / 4 warps / 2 stages and 208 B at
    # 32 rows / 8 warps; in pieces neither spills. (Triton 3.9 spills the 32-row pieces instead,
    # 104 B.)
    GATHER_N: tl.constexpr = min(BLOCK_N, 16) if TMA else BLOCK_N
    for start in range(gather_lo, hi, GATHER_N):
        pos, valid, rows = _block_rows(cache, bt_row, start, hi, stride_bt_p, stride_c_page, stride_c_tok, PAGE,
                                       GATHER_N)
        kv = _load_latent(rows, valid, L, BL, LAYOUT, GATHER_N, DOT_DTYPE, "evict_last")
        pe = _load_rope(rows, valid, L, R, BR, LAYOUT, DOT_DTYPE)
        visible = valid[:, None] & (pos[:, None] <= limit[None, :])
        m_i, l_i, accT = _attend(kv, pe, qnT, qpT, visible, scale, m_i, l_i, accT, GATHER_N, BLOCK_H, DOT_DTYPE,
                                 F32)

    factor, row_lse = _normalizer(m_i, l_i, out_scale)
    oT = accT * factor[None, :]
    o_ptrs = out + b * stride_o_b + split * stride_o_split + offs_m[None, :] * stride_o_row + offs_l[:, None]
    col_ok = offs_l[:, None] < L
    if DIRECT:
        tl.store(o_ptrs, oT.to(out.dtype.element_ty), mask=row_ok[None, :] & col_ok)
    else:  # an empty split leaves its partial out unwritten: the combine never reads it
        nonempty = tl.full([BLOCK_H], lo, lo.dtype) < hi
        tl.store(o_ptrs, oT, mask=(row_ok & nonempty)[None, :] & col_ok)
    tl.store(lse + b * stride_lse_b + split * stride_lse_split + offs_m, row_lse, mask=row_ok)
