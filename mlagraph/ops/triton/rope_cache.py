"""Triton kernels for RoPE, the latent cache writer/reader and the fused RoPE -> concat -> write.

Shapes: T tokens, H heads, Dn = q_nope width (may be 0), R = rope dim (even), L = latent width,
cache rows of W elements addressed as ``kv_cache[slot // page_size, slot % page_size]`` (the
argument check guarantees pages are dense, so slot and (page, offset) name the same row).

``_rope_cache_kernel`` (ops ``rope`` and ``fused_rope_concat_cache_write``), grid
``(T, 1 + cdiv(H, BLOCK_H))``:

- programs ``(t, hb >= 1)`` each own BLOCK_H heads of token t: they copy
  q_nope into ``q[t, h, :Dn]`` (wide vector loads/stores, a loop of BLOCK_DN chunks) and write
  the rotated q_pe into ``q[t, h, Dn:]``. This copy is almost all the bytes the op moves, so it
  is spread over many programs to run at full memory bandwidth.
- program ``(t, 0)`` rotates k_pe, stores k_rot and (if the op writes a cache and the token's
  slot is not -1) writes the token's cache row: latent kv_c and rotated k_pe in the layout's
  bytes. Blocks start in linear-id order, so these longer, latency-bound programs go out in
  the first wave, overlapped with the copies, instead of forming a tail.

Rotation: out[r] = x[r]·cos[i] + x[partner]·(±sin[i]). Interleaved (GPT-J): partner = r ^ 1,
i = r // 2, minus on even r. NeoX: partner = r ± R/2, i = r mod R/2, minus on the first half.
``a + b·(-s)`` is bit-identical to the reference's ``a - b·s``, and every kernel launches with
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA: the rotated values,
and hence the quantized cache bytes, equal the reference's.

``_cache_write_kernel`` (``latent_cache_write``), grid ``(T,)``: one program per token writes
its row with the same ``_write_row`` helper as the fused kernel.

``_cache_read_kernel`` (``latent_cache_read``), grid ``(cdiv(N, BLOCK_N),)``: each program
dequantizes BLOCK_N output rows. Row n's request is found on the device by a binary search of
cu_seq_lens (a fixed number of steps from the host-known B, no sync); its page comes from the
block table (a -1 page reads row 0, as the reference does).

Layout bytes (mlagraph/ops/layouts.py): "bf16" stores values in the cache dtype; "fp8" stores
e4m3(x / scale); "fp8_ds" stores 128-wide groups as e4m3(x / s_g) with
s_g = max(amax_g / 448, 1e-10), then the float32 s_g and the bf16 rope key, written and read
byte by byte so no aligned wide access into the uint8 row is needed. Divisions use
``div_rn`` (Triton's ``/`` is approximate on the GPU), float32 -> e4m3 goes through
``_fp8.to_fp8_bits`` and float32 -> bf16 through ``_to_bf16_grid`` (the interpreter truncates),
so the bytes are bit-identical to the reference writer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layouts
from ._fp8 import from_fp8_bits, to_fp8_bits
from ._hardware import H200_SMS, hardware
from ._launch import check_runnable

_LAYOUT_ID = {"bf16": 0, "fp8": 1, "fp8_ds": 2}
_NO_CACHE = -1  # the rope op: rotate only
_GROUP = layouts.DS_GROUP
_WAVES = 4  # aim for this many programs per SM: enough to fill the device several times over
_Q_TILE_BYTES = 9 * 1024  # q bytes per program: ~8 independent 16-byte loads per thread at 4 warps


# ---------------------------------------------------------------------------------------------
# element helpers


@triton.jit
def _to_bf16_grid(x):
    """float32 -> the nearest bf16 value (ties to even), still float32; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == ~0xFFFF
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """float32 -> DTYPE with round-to-nearest-even on the GPU and in the interpreter alike."""
    if DTYPE == tl.bfloat16:
        return _to_bf16_grid(x).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def _rope_tables(cs_ptr, pos, s_cs_p, s_cs_d, R, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(offsets r, partner offsets, mask, cos [BLOCK_R], signed sin [BLOCK_R]) of one position."""
    r = tl.arange(0, BLOCK_R)
    mask = r < R
    half = R // 2
    if INTERLEAVED:
        partner = r ^ 1
        i = r // 2
        first = (r % 2) == 0
    else:
        first = r < half
        partner = tl.where(first, r + half, r - half)
        i = tl.where(first, r, r - half)
    row = cs_ptr + pos * s_cs_p
    cos = tl.load(row + i * s_cs_d, mask=mask, other=0.0)
    sin = tl.load(row + (half + i) * s_cs_d, mask=mask, other=0.0)
    return r, partner, mask, cos, tl.where(first, -sin, sin)


@triton.jit
def _store_bytes(ptr, bits, n_bytes: tl.constexpr, stride, mask):
    """Stores the n_bytes low bytes of int32 ``bits`` little-endian at ptr, ptr+stride, ..."""
    for b in tl.static_range(n_bytes):
        tl.store(ptr + b * stride, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_bytes(ptr, n_bytes: tl.constexpr, stride, mask):
    """Inverse of _store_bytes: int32 assembled from n_bytes little-endian bytes."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    for b in tl.static_range(1, n_bytes):
        bits = bits | (tl.load(ptr + b * stride, mask=mask, other=0).to(tl.int32) << (8 * b))
    return bits


@triton.jit
def _write_row(kv_ptr, s_kv_d, k, r, mask_r, row_ptr, s_c_d, scale_ptr, L, R,
               LAYOUT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_G: tl.constexpr):
    """One cache row from kv_c (L values at kv_ptr) and k (float32 [BLOCK_R], the rope key
    already rounded to the model dtype). row_ptr is the cache dtype for "bf16", uint8 else."""
    if LAYOUT == 2:  # fp8_ds: [BLOCK_G, 128] tile of latent groups
        g = tl.arange(0, BLOCK_G)
        col = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        n_groups = L // 128
        mask_g = g < n_groups
        x = tl.load(kv_ptr + col * s_kv_d, mask=mask_g[:, None], other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-10)
        tl.store(row_ptr + col * s_c_d, to_fp8_bits(tl.math.div_rn(x, scale[:, None])), mask=mask_g[:, None])
        _store_bytes(row_ptr + (L + 4 * g) * s_c_d, scale.to(tl.int32, bitcast=True), 4, s_c_d, mask_g)
        k_bits = _to_bf16_grid(k).to(tl.int32, bitcast=True) >> 16
        _store_bytes(row_ptr + (L + 4 * n_groups + 2 * r) * s_c_d, k_bits, 2, s_c_d, mask_r)
    else:
        d = tl.arange(0, BLOCK_L)
        mask_d = d < L
        x = tl.load(kv_ptr + d * s_kv_d, mask=mask_d, other=0.0).to(tl.float32)
        if LAYOUT == 1:  # fp8: e4m3(x / scale), x / scale rounded exactly as torch divides
            s = tl.load(scale_ptr)
            tl.store(row_ptr + d * s_c_d, to_fp8_bits(tl.math.div_rn(x, s)), mask=mask_d)
            tl.store(row_ptr + (L + r) * s_c_d, to_fp8_bits(tl.math.div_rn(k, s)), mask=mask_r)
        else:  # bf16: plain values in the cache dtype
            dtype = row_ptr.dtype.element_ty
            tl.store(row_ptr + d * s_c_d, _cast(x, dtype), mask=mask_d)
            tl.store(row_ptr + (L + r) * s_c_d, _cast(k, dtype), mask=mask_r)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _rope_cache_kernel(
    qn_ptr, qp_ptr, kp_ptr, kv_ptr, pos_ptr, cs_ptr, q_ptr, k_ptr, cache_ptr, slot_ptr, scale_ptr,
    H, DN, R, L, page_size,
    s_qn_t, s_qn_h, s_qn_d, s_qp_t, s_qp_h, s_qp_d, s_kp_t, s_kp_d, s_kv_t, s_kv_d, s_cs_p, s_cs_d,
    s_c_p, s_c_s, s_c_d,
    INTERLEAVED: tl.constexpr, LAYOUT: tl.constexpr, EVEN_DN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_G: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    r, partner, mask_r, cos, sin = _rope_tables(cs_ptr, pos, s_cs_p, s_cs_d, R, BLOCK_R, INTERLEAVED)
    dtype = q_ptr.dtype.element_ty
    if hb > 0:
        # q[t, heads] = cat(q_nope, rope(q_pe)); q is contiguous [T, H, DN + R].
        width = DN + R
        heads = (hb - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < H
        src = qn_ptr + t * s_qn_t + heads[:, None] * s_qn_h
        dst = q_ptr + t * H * width + heads[:, None] * width
        for d0 in range(0, DN, BLOCK_DN):
            d = d0 + tl.arange(0, BLOCK_DN)[None, :]
            if EVEN_DN:  # no column mask: keeps the loads and stores fully vectorized
                mask = mask_h[:, None]
            else:
                mask = mask_h[:, None] & (d < DN)
            tl.store(dst + d, tl.load(src + d * s_qn_d, mask=mask), mask=mask)
        src = qp_ptr + t * s_qp_t + heads[:, None] * s_qp_h
        mask = mask_h[:, None] & mask_r[None, :]
        x = tl.load(src + r[None, :] * s_qp_d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(src + partner[None, :] * s_qp_d, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + DN + r[None, :], _cast(x * cos[None, :] + xp * sin[None, :], dtype), mask=mask)
    else:
        # (names differ from the q branch's: Triton wants a name bound in both branches to
        # have one type)
        k_src = kp_ptr + t * s_kp_t
        kx = tl.load(k_src + r * s_kp_d, mask=mask_r, other=0.0).to(tl.float32)
        kxp = tl.load(k_src + partner * s_kp_d, mask=mask_r, other=0.0).to(tl.float32)
        k = _cast(kx * cos + kxp * sin, dtype)
        tl.store(k_ptr + t * R + r, k, mask=mask_r)
        if LAYOUT >= 0:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                row = cache_ptr + (slot // page_size) * s_c_p + (slot % page_size) * s_c_s
                # The cache gets k_rot as the reference writes it: rounded to the model dtype.
                _write_row(kv_ptr + t * s_kv_t, s_kv_d, k.to(tl.float32), r, mask_r, row, s_c_d, scale_ptr,
                           L, R, LAYOUT, BLOCK_L, BLOCK_G)


@triton.jit
def _cache_write_kernel(
    kv_ptr, kp_ptr, cache_ptr, slot_ptr, scale_ptr, L, R, page_size,
    s_kv_t, s_kv_d, s_kp_t, s_kp_d, s_c_p, s_c_s, s_c_d,
    LAYOUT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        mask_r = r < R
        k = tl.load(kp_ptr + t * s_kp_t + r * s_kp_d, mask=mask_r, other=0.0).to(tl.float32)
        row = cache_ptr + (slot // page_size) * s_c_p + (slot % page_size) * s_c_s
        _write_row(kv_ptr + t * s_kv_t, s_kv_d, k, r, mask_r, row, s_c_d, scale_ptr, L, R, LAYOUT, BLOCK_L, BLOCK_G)


@triton.jit
def _cache_read_kernel(
    cache_ptr, bt_ptr, cu_ptr, scale_ptr, kv_ptr, kp_ptr,
    N, B, P, L, R, page_size, search_steps,
    s_bt_b, s_bt_p, s_c_p, s_c_s, s_c_d,
    LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < N
    # req = searchsorted(cu_seq_lens, n, right=True) - 1: lo ends as the count of cu <= n.
    lo = tl.zeros([BLOCK_N], dtype=tl.int32)
    hi = lo + B + 1
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        go_right = active & (tl.load(cu_ptr + mid, mask=active, other=0) <= n)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    req = tl.minimum(tl.maximum(lo - 1, 0), B - 1)
    # Clamps keep broken metadata from faulting (it reads garbage, as the reference does).
    pos = tl.maximum(n - tl.load(cu_ptr + req, mask=mask_n, other=0), 0)
    page_idx = tl.minimum(pos // page_size, P - 1)
    page = tl.load(bt_ptr + req.to(tl.int64) * s_bt_b + page_idx * s_bt_p, mask=mask_n, other=0).to(tl.int64)
    # A -1 page reads row 0. (Select page and offset, not the final offset: a select against a
    # constant 0 hides the offset's alignment from Triton and the row loads stop vectorizing.)
    valid = page >= 0
    page = tl.where(valid, page, 0)
    in_page = tl.where(valid, pos % page_size, 0)
    row = cache_ptr + (page * s_c_p + in_page * s_c_s)[:, None]
    n64 = n.to(tl.int64)[:, None]
    dtype = kv_ptr.dtype.element_ty
    r = tl.arange(0, BLOCK_R)[None, :]
    mask_r = mask_n[:, None] & (r < R)
    if LAYOUT == 2:  # fp8_ds: groups as a [BLOCK_N, BLOCK_G, 128] tile
        n_groups = L // 128
        g = tl.arange(0, BLOCK_G)[None, :]
        mask_g = mask_n[:, None] & (g < n_groups)
        scale = _load_bytes(row + (L + 4 * g) * s_c_d, 4, s_c_d, mask_g).to(tl.float32, bitcast=True)
        col = g[:, :, None] * 128 + tl.arange(0, 128)[None, None, :]
        x = from_fp8_bits(tl.load(row[:, :, None] + col * s_c_d, mask=mask_g[:, :, None], other=0))
        tl.store(kv_ptr + n64[:, :, None] * L + col, _cast(x * scale[:, :, None], dtype), mask=mask_g[:, :, None])
        k_bits = _load_bytes(row + (L + 4 * n_groups + 2 * r) * s_c_d, 2, s_c_d, mask_r)
        k = (k_bits << 16).to(tl.float32, bitcast=True)
    else:
        d = tl.arange(0, BLOCK_L)[None, :]
        mask_d = mask_n[:, None] & (d < L)
        x = tl.load(row + d * s_c_d, mask=mask_d, other=0)
        k = tl.load(row + (L + r) * s_c_d, mask=mask_r, other=0)
        if LAYOUT == 1:  # fp8: e4m3 bits times the per-tensor scale
            s = tl.load(scale_ptr)
            x = from_fp8_bits(x) * s
            k = from_fp8_bits(k) * s
        tl.store(kv_ptr + n64 * L + d, _cast(x.to(tl.float32), dtype), mask=mask_d)
    tl.store(kp_ptr + n64 * R + r, _cast(k.to(tl.float32), dtype), mask=mask_r)


# ---------------------------------------------------------------------------------------------
# launch configs (from shapes only)


def _pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _floor_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def rope_cache_config(num_tokens: int, num_heads: int, nope_dim: int, rope_dim: int, itemsize: int,
                      num_sms: int = H200_SMS) -> dict:
    """Default launch config of the rope / fused kernel (a benchmark may override any key).

    block_h: heads per q program, a power of two <= 16: the largest whose q rows stay within
    ~_Q_TILE_BYTES, halved while there are fewer than _WAVES programs per SM. Decode with
    Dn=512, R=64, bf16: B=128 -> 8 (2048 q programs of 9 KB, 4 warps, ~56 registers on sm_90);
    B=1 -> 1 (128 one-warp programs: a latency-bound launch wants them short). block_dn:
    q_nope columns per loop step (<= 512). num_warps: one per ~2 KB of the q tile (<= 8).
    """
    row_bytes = (_pow2(nope_dim) + _pow2(rope_dim)) * itemsize
    block_h = 16
    while block_h > 1 and (block_h * row_bytes > _Q_TILE_BYTES
                           or num_tokens * triton.cdiv(num_heads, block_h) < _WAVES * num_sms):
        block_h //= 2
    block_dn = min(_pow2(max(nope_dim, 16)), 512)
    num_warps = min(_floor_pow2(block_h * row_bytes // 2048), 8)
    return {"block_h": block_h, "block_dn": block_dn, "num_warps": num_warps, "num_stages": 1}


def cache_read_config(num_tokens: int, kv_lora_rank: int, num_sms: int = H200_SMS) -> dict:
    """Default launch config of the reader: ~4096 latent values per program (BLOCK_N rows),
    fewer rows when that would leave too few programs."""
    block_n = min(max(_floor_pow2(4096 // _pow2(kv_lora_rank)), 1), 64)
    while block_n > 1 and triton.cdiv(num_tokens, block_n) < _WAVES * num_sms:
        block_n //= 2
    return {"block_n": block_n, "num_warps": 4, "num_stages": 1}


def cache_write_config(kv_lora_rank: int) -> dict:
    """Default launch config of the writer (one program per token)."""
    return {"num_warps": min(max(_pow2(kv_lora_rank) // 128, 1), 4), "num_stages": 1}


def _cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    # fp8 bytes travel as uint8 (the kernels quantize through their own rounding).
    return kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache


def _layout_blocks(latent: int, rope_dim: int) -> dict:
    return {"BLOCK_L": _pow2(latent), "BLOCK_G": _pow2(max(latent // _GROUP, 1)), "BLOCK_R": _pow2(rope_dim)}


# ---------------------------------------------------------------------------------------------
# ops


def _rope_concat(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout,
                 interleaved, config):
    """The shared launcher: q = cat(q_nope, rope(q_pe)), k_rot, and (layout given) the cache rows."""
    t, h, dn = q_nope.shape
    r = q_pe.shape[2]
    q = torch.empty((t, h, dn + r), dtype=q_pe.dtype, device=q_pe.device)
    k = torch.empty((t, 1, r), dtype=q_pe.dtype, device=q_pe.device)
    if t == 0:
        return q, k
    cfg = {**rope_cache_config(t, h, dn, r, q_pe.element_size(), hardware(q_pe.device).num_sms), **(config or {})}
    if layout is None:
        layout_id, cache, latent = _NO_CACHE, q_pe, 1
        kv_c = k_pe[:, 0]  # unused placeholders for the cache arguments (k_pe always has a head)
        slot_mapping, cache_strides, page_size = positions, (0, 0, 0), 1
    else:
        layout_id, cache, latent = _LAYOUT_ID[layout], _cache_view(kv_cache), kv_c.shape[1]
        cache_strides, page_size = cache.stride(), cache.shape[1]
    grid = (t, 1 + triton.cdiv(h, cfg["block_h"]))
    _rope_cache_kernel[grid](
        q_nope, q_pe, k_pe, kv_c, positions, cos_sin_cache, q, k, cache, slot_mapping,
        scale if scale is not None else cos_sin_cache,
        h, dn, r, latent, page_size,
        *q_nope.stride(), *q_pe.stride(), k_pe.stride(0), k_pe.stride(2), *kv_c.stride(), *cos_sin_cache.stride(),
        *cache_strides,
        INTERLEAVED=bool(interleaved), LAYOUT=layout_id, EVEN_DN=dn % cfg["block_dn"] == 0,
        BLOCK_H=cfg["block_h"], BLOCK_DN=cfg["block_dn"], **_layout_blocks(latent, r),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False,
    )
    return q, k


def rope(q_pe, k_pe, positions, cos_sin_cache, interleaved, *, config=None):
    """mlagraph::rope: (q_rot [T, H, R], k_rot [T, 1, R]); ``config`` overrides rope_cache_config."""
    check_runnable("rope", _rope_cache_kernel, q_pe)
    q_nope = q_pe[:, :, :0]  # zero-width: the q programs only rotate
    return _rope_concat(q_nope, q_pe, None, k_pe, positions, cos_sin_cache, None, None, None, None,
                        interleaved, config)


def fused_rope_concat_cache_write(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping,
                                  scale, layout, interleaved, *, config=None):
    """mlagraph::fused_rope_concat_cache_write in one launch; ``config`` overrides rope_cache_config."""
    check_runnable("fused_rope_concat_cache_write", _rope_cache_kernel, q_nope)
    return _rope_concat(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale,
                        layout, interleaved, config)


def latent_cache_write(kv_c, k_pe, kv_cache, slot_mapping, scale, layout, *, config=None):
    """mlagraph::latent_cache_write: one program per token; ``config`` overrides cache_write_config."""
    check_runnable("latent_cache_write", _cache_write_kernel, kv_c)
    t, latent = kv_c.shape
    if t == 0:
        return None
    r = k_pe.shape[1]
    cfg = {**cache_write_config(latent), **(config or {})}
    cache = _cache_view(kv_cache)
    _cache_write_kernel[(t,)](
        kv_c, k_pe, cache, slot_mapping, scale if scale is not None else kv_c, latent, r, cache.shape[1],
        *kv_c.stride(), *k_pe.stride(), *cache.stride(),
        LAYOUT=_LAYOUT_ID[layout], **_layout_blocks(latent, r),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False,
    )
    return None


def latent_cache_read(kv_cache, block_table, cu_seq_lens, scale, layout, rope_dim, out_dtype, num_tokens, *,
                      config=None):
    """mlagraph::latent_cache_read: (kv_c [N, L], k_pe [N, R]); ``config`` overrides cache_read_config."""
    check_runnable("latent_cache_read", _cache_read_kernel, kv_cache)
    latent = layouts.latent_kv_lora_rank(layout, kv_cache.shape[2], rope_dim)
    kv_c = torch.empty((num_tokens, latent), dtype=out_dtype, device=kv_cache.device)
    k_pe = torch.empty((num_tokens, rope_dim), dtype=out_dtype, device=kv_cache.device)
    num_reqs, max_pages = block_table.shape
    if num_tokens == 0 or num_reqs == 0 or max_pages == 0:
        # No request (or no page) to read from: only broken metadata gets here with N > 0.
        return kv_c.zero_(), k_pe.zero_()
    cfg = {**cache_read_config(num_tokens, latent, hardware(kv_cache.device).num_sms), **(config or {})}
    cache = _cache_view(kv_cache)
    grid = (triton.cdiv(num_tokens, cfg["block_n"]),)
    _cache_read_kernel[grid](
        cache, block_table, cu_seq_lens, scale if scale is not None else cu_seq_lens, kv_c, k_pe,
        num_tokens, num_reqs, max_pages, latent, rope_dim, cache.shape[1], (num_reqs + 1).bit_length(),
        *block_table.stride(), *cache.stride(),
        LAYOUT=_LAYOUT_ID[layout], BLOCK_N=cfg["block_n"], **_layout_blocks(latent, rope_dim),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False,
    )
    return kv_c, k_pe
