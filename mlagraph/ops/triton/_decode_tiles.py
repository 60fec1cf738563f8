"""What every ``mla_decode`` kernel form shares (see :mod:`.decode`): a request's key run cut
into splits on the device, the program's query rows and their causal limits, the fp8 scale
folded into scores and output, latent and rope rows gathered from the paged cache with masks,
the dot that runs in exact float32 where asked, and the softmax's final normalisation."""

from __future__ import annotations

import triton
import triton.language as tl

from ._fp8 import from_fp8_bits


@triton.jit
def _split_len(kv_len, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Keys per split: the request's BLOCK_N blocks cut into MAX_SPLITS runs of equal length (the
    last runs may be short or empty). Computed on the device, from the request's own length."""
    return tl.cdiv(tl.cdiv(kv_len, BLOCK_N), MAX_SPLITS) * BLOCK_N


@triton.jit
def _kv_len(seq_len, MAX_LEN):
    """Keys of a request that exist in its block table (0 for a padding request)."""
    return tl.minimum(tl.maximum(seq_len, 0), MAX_LEN)


@triton.jit
def _split_run(seq_lens, b, stride_sl, MAX_LEN, split, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Request b's length and this split's keys [lo, hi) (lo >= hi: an empty split)."""
    seq_len = tl.load(seq_lens + b * stride_sl)
    kv_len = _kv_len(seq_len, MAX_LEN)
    per_split = _split_len(kv_len, BLOCK_N, MAX_SPLITS)
    lo = split * per_split
    return seq_len, lo, tl.minimum(lo + per_split, kv_len)


@triton.jit
def _query_rows(row_block, seq_len, S_Q: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """This block's rows (query i, head h) -> (offs_m, row_ok, qi, qh, limit [BLOCK_H]): each row
    sees positions <= its own, ``limit`` (the causal limit)."""
    offs_m = row_block * BLOCK_H + tl.arange(0, BLOCK_H)
    qi = offs_m // H
    return offs_m, offs_m < S_Q * H, qi, offs_m % H, seq_len - S_Q + qi


@triton.jit
def _score_scales(fp8_scale, qk_scale, LAYOUT: tl.constexpr):
    """(score scale, output scale): fp8 caches hold e4m3 * a per-tensor scale, applied to both."""
    scale = qk_scale
    out_scale = 1.0
    if LAYOUT == 1:
        kv_scale = tl.load(fp8_scale)
        scale = qk_scale * kv_scale
        out_scale = kv_scale
    return scale, out_scale


@triton.jit
def _block_rows(cache, bt_row, start, hi, stride_bt_p, stride_c_page, stride_c_tok, PAGE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Keys start..start+BLOCK_N -> (pos, valid, rows [BLOCK_N] cache row pointers): page ids from
    the block table; a -1 page or a position past hi is not valid (its row is never read)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_run = pos < hi
    page = tl.load(bt_row + (pos // PAGE) * stride_bt_p, mask=in_run, other=-1)
    valid = in_run & (page >= 0)
    return pos, valid, cache + page.to(tl.int64) * stride_c_page + (pos % PAGE) * stride_c_tok


@triton.jit
def _normalizer(m_i, l_i, out_scale):
    """The online softmax's end: (out's factor out_scale / l, lse in natural log) per row; a row
    that saw no key gets factor out_scale and lse -inf (its accumulator is 0)."""
    has_key = l_i > 0.0
    factor = out_scale / tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return factor, lse


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b, float32 accumulation; F32: exact float32 operands (no TF32)."""
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_latent(rows, valid, L: tl.constexpr, BL: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, POLICY: tl.constexpr):
    """rows [BLOCK_N] pointers to cache rows -> kv_c [BLOCK_N, BL] in DOT_DTYPE (BL >= L: columns
    past L, which only tiny test models have, read as 0).

    Masked keys read as 0 (the cache may hold NaN there, and 0 weight * NaN is NaN). fp8 values
    are returned unscaled: the caller folds the per-tensor scale into scores and output."""
    offs_l = tl.arange(0, BL)
    ptrs = rows[:, None] + offs_l[None, :]
    m = valid[:, None] & (offs_l[None, :] < L)
    if LAYOUT == 0:  # bf16: kv_c | k_pe in the cache's float dtype
        kv = tl.load(ptrs, mask=m, other=0.0, eviction_policy=POLICY)
    elif LAYOUT == 1:  # fp8: L + R e4m3 bytes
        # e4m3 -> DOT_DTYPE in one exact conversion (through float32 it costs twice the registers)
        kv = tl.load(ptrs, mask=m, other=0, eviction_policy=POLICY).to(tl.float8e4nv, bitcast=True)
    else:  # fp8_ds: L e4m3 bytes | L/128 float32 scales | R bf16 (row addresses in bytes)
        G: tl.constexpr = L // 128  # layouts.DS_GROUP
        bits = tl.load(ptrs, mask=m, other=0, eviction_policy=POLICY)
        # Cast the row pointers, then add column offsets: keeps the loads vectorized.
        scale_rows = (rows + L).to(tl.pointer_type(tl.float32))
        scales = tl.load(scale_rows[:, None] + tl.arange(0, G)[None, :], mask=valid[:, None], other=0.0,
                         eviction_policy=POLICY)  # [BLOCK_N, G]
        kv = tl.reshape(tl.reshape(from_fp8_bits(bits), [BLOCK_N, G, 128]) * scales[:, :, None], [BLOCK_N, L])
    return kv.to(DOT_DTYPE)


@triton.jit
def _load_rope(rows, valid, L: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, LAYOUT: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """rows [BLOCK_N] pointers to cache rows -> k_pe [BLOCK_N, BR] in DOT_DTYPE (0 where masked)."""
    offs_r = tl.arange(0, BR)
    m = valid[:, None] & (offs_r[None, :] < R)
    if LAYOUT == 0:
        pe = tl.load(rows[:, None] + L + offs_r[None, :], mask=m, other=0.0)
    elif LAYOUT == 1:
        pe = from_fp8_bits(tl.load(rows[:, None] + L + offs_r[None, :], mask=m, other=0))
    else:
        pe_rows = (rows + L + 4 * (L // 128)).to(tl.pointer_type(tl.bfloat16))
        pe = tl.load(pe_rows[:, None] + offs_r[None, :], mask=m, other=0.0)
    return pe.to(DOT_DTYPE)
