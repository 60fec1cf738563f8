"""The tiles every ``mla_decode`` kernel form reads (see :mod:`.decode`): a request's key run
cut into splits on the device, latent and rope rows gathered from the paged cache with masks,
and the dot that runs in exact float32 where asked."""

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
        kv = from_fp8_bits(tl.load(ptrs, mask=m, other=0, eviction_policy=POLICY))
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
