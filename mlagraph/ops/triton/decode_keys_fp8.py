"""Triton ``mla_decode``, keys-major form for the fp8 caches ("fp8", "fp8_ds"): the latent in
four column chunks, kept as bytes.

Same splits, masks, loads and products as :mod:`.decode_keys` (read it first); what differs is
where the e4m3 bytes become DOT_DTYPE values. Converting a whole [BLOCK_N, L] tile and keeping
it for the second product, past the softmax, holds 64 keys x 512 columns in registers as values
(and as bytes while converting): built for sm_90 with Triton 3.6 that spilled 1080 B a thread
("fp8") and 2088 B ("fp8_ds") at 64 keys / 4 warps / 2 stages. Here the latent is read as four
[BLOCK_N, CW] byte chunks (CW = BL / 4), held as bytes (a quarter of float32's registers, half of
bf16's), and each chunk is converted twice, once for each product:

    sT     = pe @ qpT + sum_c s_c * (kv_c @ qnT_c)       c = 0..3, s_c [BLOCK_N]: chunk c's scale
    accT_c = accT_c * alpha + kv_c^T @ (p * s_c)         accT_c [CW, BLOCK_H], one per chunk

"fp8_ds" scales each key's 128-column group; a chunk lies in one group (CW <= 128, so L <= 512),
so its scale is per key there and moves onto the chunk's scores and the chunk's probabilities:
the byte -> value conversion is exact and no [BLOCK_N, L] multiply runs. "fp8"'s per-tensor scale
is folded into the score scale and the output as in every form (s_c = 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_tiles import _block_rows, _dot, _load_rope, _normalizer, _query_rows, _score_scales, _split_run
from ._fp8 import from_fp8_bits


@triton.jit
def _chunk_scales(rows, valid, L: tl.constexpr, CW: tl.constexpr, LAYOUT: tl.constexpr):
    """"fp8_ds": the four chunks' scales, [BLOCK_N] float32 each, from the float32 group scales at
    byte L of each row (rows: byte pointers; 0 where not valid). "fp8": 1.0 (unused)."""
    if LAYOUT == 2:
        groups = (rows + L).to(tl.pointer_type(tl.float32))
        s0 = tl.load(groups + (0 * CW) // 128, mask=valid, other=0.0)
        s1 = tl.load(groups + (1 * CW) // 128, mask=valid, other=0.0)
        s2 = tl.load(groups + (2 * CW) // 128, mask=valid, other=0.0)
        s3 = tl.load(groups + (3 * CW) // 128, mask=valid, other=0.0)
    else:
        s0 = 1.0
        s1 = 1.0
        s2 = 1.0
        s3 = 1.0
    return s0, s1, s2, s3


@triton.jit
def _gather_bits(rows, valid, c: tl.constexpr, L: tl.constexpr, CW: tl.constexpr):
    """Chunk c's bytes [BLOCK_N, CW] of the rows (0 where not valid or past L)."""
    cols = c * CW + tl.arange(0, CW)
    return tl.load(rows[:, None] + cols[None, :], mask=valid[:, None] & (cols[None, :] < L), other=0,
                   eviction_policy="evict_last")


@triton.jit
def _chunk_scores(bits, s, qnT_c, sT, LAYOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, F32: tl.constexpr):
    """sT + s * (kv_c @ qnT_c), keys x rows; kv_c converted from its bytes here."""
    kv = bits.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)  # e4m3 -> DOT_DTYPE directly, exact
    if LAYOUT == 2:
        return sT + s[:, None] * _dot(kv, qnT_c, tl.zeros_like(sT), F32)
    else:
        return _dot(kv, qnT_c, sT, F32)


@triton.jit
def _chunk_values(bits, s, p, accT_c, LAYOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, F32: tl.constexpr):
    """accT_c + kv_c^T @ (p * s): chunk c's rows of the output, converted again from its bytes."""
    kvT = tl.trans(bits).to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    if LAYOUT == 2:
        p = p * s[:, None]
    return _dot(kvT, p.to(DOT_DTYPE), accT_c, F32)


@triton.jit
def _attend_chunks(b0, b1, b2, b3, s0, s1, s2, s3, pe, q0, q1, q2, q3, qpT, visible, scale, m_i, l_i,
                   a0, a1, a2, a3, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, F32: tl.constexpr):
    """One block of keys (four byte chunks b_c, their scales s_c) into the online softmax (base 2)."""
    sT = _dot(pe, qpT, tl.zeros([BLOCK_N, BLOCK_H], tl.float32), F32)
    sT = _chunk_scores(b0, s0, q0, sT, LAYOUT, DOT_DTYPE, F32)
    sT = _chunk_scores(b1, s1, q1, sT, LAYOUT, DOT_DTYPE, F32)
    sT = _chunk_scores(b2, s2, q2, sT, LAYOUT, DOT_DTYPE, F32)
    sT = _chunk_scores(b3, s3, q3, sT, LAYOUT, DOT_DTYPE, F32)
    sT = tl.where(visible, sT * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sT, 0))
    # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(sT - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    a0 = _chunk_values(b0, s0, p, a0 * alpha[None, :], LAYOUT, DOT_DTYPE, F32)
    a1 = _chunk_values(b1, s1, p, a1 * alpha[None, :], LAYOUT, DOT_DTYPE, F32)
    a2 = _chunk_values(b2, s2, p, a2 * alpha[None, :], LAYOUT, DOT_DTYPE, F32)
    a3 = _chunk_values(b3, s3, p, a3 * alpha[None, :], LAYOUT, DOT_DTYPE, F32)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _query_chunk(q_row, row_ok, c: tl.constexpr, L: tl.constexpr, CW: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Chunk c of the queries transposed, [CW, BLOCK_H] (q_row: [BLOCK_H] pointers to each row's latent)."""
    cols = c * CW + tl.arange(0, CW)
    return tl.load(q_row[None, :] + cols[:, None], mask=row_ok[None, :] & (cols[:, None] < L),
                   other=0.0).to(DOT_DTYPE)


@triton.jit
def _store_chunk(o_row, oT_c, ok, c: tl.constexpr, L: tl.constexpr, CW: tl.constexpr):
    cols = c * CW + tl.arange(0, CW)
    tl.store(o_row[None, :] + cols[:, None], oT_c.to(o_row.dtype.element_ty), mask=ok[None, :] & (cols[:, None] < L))


@triton.jit
def _split_keys_fp8_kernel(
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
    TMA: tl.constexpr,  # whole blocks through the descriptors: lat_desc's boxes are [BLOCK_N, BL // 4]
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    DOT_DTYPE: tl.constexpr = tl.float32 if F32 else (tl.float16 if FP16 else q_nope.dtype.element_ty)
    CW: tl.constexpr = BL // 4

    seq_len, lo, hi = _split_run(seq_lens, b, stride_sl, MAX_LEN, split, BLOCK_N, MAX_SPLITS)
    offs_m, row_ok, qi, qh, limit = _query_rows(row_block, seq_len, S_Q, H, BLOCK_H)
    q_row = q_nope + b * stride_qn_b + qi * stride_qn_s + qh * stride_qn_h
    q0 = _query_chunk(q_row, row_ok, 0, L, CW, DOT_DTYPE)
    q1 = _query_chunk(q_row, row_ok, 1, L, CW, DOT_DTYPE)
    q2 = _query_chunk(q_row, row_ok, 2, L, CW, DOT_DTYPE)
    q3 = _query_chunk(q_row, row_ok, 3, L, CW, DOT_DTYPE)
    offs_r = tl.arange(0, BR)
    qpT = tl.load(q_pe + b * stride_qp_b + (qi * stride_qp_s + qh * stride_qp_h)[None, :] + offs_r[:, None],
                  mask=row_ok[None, :] & (offs_r[:, None] < R), other=0.0).to(DOT_DTYPE)

    scale, out_scale = _score_scales(fp8_scale, qk_scale, LAYOUT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([CW, BLOCK_H], tl.float32)
    a1 = tl.zeros([CW, BLOCK_H], tl.float32)
    a2 = tl.zeros([CW, BLOCK_H], tl.float32)
    a3 = tl.zeros([CW, BLOCK_H], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table + b * stride_bt_b
    gather_lo = lo
    if TMA:
        gather_lo = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)  # the partial block's start
        for start in range(lo, gather_lo, BLOCK_N):
            page = tl.load(bt_row + (start // PAGE) * stride_bt_p)
            row0 = page * PAGE + start % PAGE  # negative for a -1 page: the engine reads zeros
            b0 = lat_desc.load([row0, 0])
            b1 = lat_desc.load([row0, CW])
            b2 = lat_desc.load([row0, 2 * CW])
            b3 = lat_desc.load([row0, 3 * CW])
            if LAYOUT == 1:
                pe = from_fp8_bits(pe_desc.load([row0, L]))
            else:
                pe = pe_desc.load([row0, L // 2 + 2 * (L // 128)])  # bf16 at byte L + 4 * groups
            rows = cache + (row0 + offs_n).to(tl.int64) * stride_c_tok  # pages lie back to back
            s0, s1, s2, s3 = _chunk_scales(rows, page + 0 * offs_n >= 0, L, CW, LAYOUT)  # a [BLOCK_N] mask
            visible = (page >= 0) & ((start + offs_n)[:, None] <= limit[None, :])
            m_i, l_i, a0, a1, a2, a3 = _attend_chunks(b0, b1, b2, b3, s0, s1, s2, s3, pe.to(DOT_DTYPE), q0, q1, q2,
                                                      q3, qpT, visible, scale, m_i, l_i, a0, a1, a2, a3, LAYOUT,
                                                      BLOCK_N, BLOCK_H, DOT_DTYPE, F32)
    # The partial block (with TMA) or every block (without) gathered with masks; with TMA in
    # 16-key pieces, as in decode_keys.
    GATHER_N: tl.constexpr = min(BLOCK_N, 16) if TMA else BLOCK_N
    for start in range(gather_lo, hi, GATHER_N):
        pos, valid, rows = _block_rows(cache, bt_row, start, hi, stride_bt_p, stride_c_page, stride_c_tok, PAGE,
                                       GATHER_N)
        b0 = _gather_bits(rows, valid, 0, L, CW)
        b1 = _gather_bits(rows, valid, 1, L, CW)
        b2 = _gather_bits(rows, valid, 2, L, CW)
        b3 = _gather_bits(rows, valid, 3, L, CW)
        s0, s1, s2, s3 = _chunk_scales(rows, valid, L, CW, LAYOUT)
        pe = _load_rope(rows, valid, L, R, BR, LAYOUT, DOT_DTYPE)
        visible = valid[:, None] & (pos[:, None] <= limit[None, :])
        m_i, l_i, a0, a1, a2, a3 = _attend_chunks(b0, b1, b2, b3, s0, s1, s2, s3, pe, q0, q1, q2, q3, qpT, visible,
                                                  scale, m_i, l_i, a0, a1, a2, a3, LAYOUT, GATHER_N, BLOCK_H,
                                                  DOT_DTYPE, F32)

    factor, row_lse = _normalizer(m_i, l_i, out_scale)
    o_row = out + b * stride_o_b + split * stride_o_split + offs_m * stride_o_row
    ok = row_ok
    if not DIRECT:  # an empty split leaves its partial out unwritten: the combine never reads it
        ok = row_ok & (tl.full([BLOCK_H], lo, lo.dtype) < hi)
    _store_chunk(o_row, a0 * factor[None, :], ok, 0, L, CW)
    _store_chunk(o_row, a1 * factor[None, :], ok, 1, L, CW)
    _store_chunk(o_row, a2 * factor[None, :], ok, 2, L, CW)
    _store_chunk(o_row, a3 * factor[None, :], ok, 3, L, CW)
    tl.store(lse + b * stride_lse_b + split * stride_lse_split + offs_m, row_lse, mask=row_ok)
