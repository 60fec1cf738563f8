"""``sparse_mla``: absorbed MLA of each token over the cached keys its indexer selected (DSA).

Shapes: q_nope [T, H, L], q_pe [T, H, R] (DeepSeek: H = 128, L = 512, R = 64), topk_indices
[T, K] key POSITIONS within the token's request (-1 = none), req_ids [T], block_table [B, P],
kv_cache [num_pages, page_size, W] in one of the latent layouts of :mod:`mlagraph.ops.layouts`.
Per head, score = softmax_scale * (q_nope . kv_c + q_pe . k_pe) and the latent kv_c is both key
and value: out [T, H, L], lse [T, H] (natural log), out 0 / lse -inf for a token with no key.

Grid: one program per (token, block of BLOCK_H heads), flat, with the head block fastest so the
programs of one token run side by side and the second reads the selected rows from L2 (each row
comes from memory about once per token). A program walks the K indices in blocks of BLOCK_N:
position -> page through the block table -> slot, a masked gather of the rows (a -1 index, a
position past the table and a -1 page are masked out and never read; the cache may hold NaN
there), then an online softmax in base 2 with float32 accumulators, the two dots of the score
(latent + rope) and the value dot on the same gathered latent tile.

Layouts: "bf16" rows are read as stored (bf16/fp16/fp32). "fp8" rows are e4m3 values of x/scale:
they convert exactly to the dot dtype and the per-tensor scale is applied to the scores and to
the output instead of to every element. "fp8_ds" rows (L e4m3 | L/128 float32 scales | R bf16)
are dequantized per 128-value group in registers before the dots. Dots run in q's dtype (bf16 on
the fast path) with float32 accumulation; float32 queries use exact ("ieee") dots.

On Hopper, bf16 queries and caches at DeepSeek's widths and more than 16 heads run the Gluon
form instead (:mod:`.sparse_wgmma`: the two warp groups split the scores rather than both
computing them; :func:`wgmma_blocks` says where it cannot run); ``config`` picks either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layouts import DS_GROUP
from ._fp8 import from_fp8_bits
from . import decode_stream, decode_wgmma, seesaw, sparse_wgmma
from ._hardware import interpreted
from ._launch import check_runnable
from ._tl import dot as _dot

LOG2E = 1.4426950408889634
_LAYOUT_IDS = {"bf16": 0, "fp8": 1, "fp8_ds": 2}


@triton.jit
def _gather_rows(cache_ptr, rows, valid, cols_l, cols_r, L: tl.constexpr, R: tl.constexpr,
                 B_L: tl.constexpr, B_R: tl.constexpr, LAYOUT: tl.constexpr, DS_GROUP: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """Rows at element offsets ``rows`` [BLOCK_N] (int64) -> kv_c [BLOCK_N, B_L], k_pe
    [BLOCK_N, B_R] in DOT_DTYPE; invalid rows read as 0 without touching memory."""
    base = cache_ptr + rows
    lmask = valid[:, None] & (cols_l[None, :] < L)
    rmask = valid[:, None] & (cols_r[None, :] < R)
    if LAYOUT == 0:  # bf16: [L | R] in the cache's dtype
        kv_c = tl.load(base[:, None] + cols_l[None, :], mask=lmask, other=0.0).to(DOT_DTYPE)
        k_pe = tl.load(base[:, None] + L + cols_r[None, :], mask=rmask, other=0.0).to(DOT_DTYPE)
    elif LAYOUT == 1:  # fp8: [L | R] e4m3 of x / scale; e4m3 -> bf16/fp16/fp32 is exact
        kv_c = from_fp8_bits(tl.load(base[:, None] + cols_l[None, :], mask=lmask, other=0)).to(DOT_DTYPE)
        k_pe = from_fp8_bits(tl.load(base[:, None] + L + cols_r[None, :], mask=rmask, other=0)).to(DOT_DTYPE)
    else:  # fp8_ds: L e4m3 | L / 128 float32 group scales | R bf16, addressed in bytes
        NG: tl.constexpr = L // DS_GROUP
        q8 = from_fp8_bits(tl.load(base[:, None] + cols_l[None, :], mask=lmask, other=0))
        scale_ptr = (base + L).to(tl.pointer_type(tl.float32))
        if B_L == L:
            # Power-of-two L: one [BLOCK_N, NG] scale load, broadcast over each group of 128.
            groups = tl.arange(0, NG)
            gs = tl.load(scale_ptr[:, None] + groups[None, :], mask=valid[:, None], other=0.0)
            q8 = tl.reshape(tl.reshape(q8, (q8.shape[0], NG, DS_GROUP)) * gs[:, :, None], (q8.shape[0], B_L))
        else:
            q8 = q8 * tl.load(scale_ptr[:, None] + cols_l[None, :] // DS_GROUP, mask=lmask, other=0.0)
        kv_c = q8.to(DOT_DTYPE)
        pe_ptr = (base + L + 4 * NG).to(tl.pointer_type(tl.bfloat16))
        k_pe = tl.load(pe_ptr[:, None] + cols_r[None, :], mask=rmask, other=0.0).to(DOT_DTYPE)
    return kv_c, k_pe


@triton.jit
def _sparse_mla_kernel(
    qn_ptr, qp_ptr, cache_ptr, topk_ptr, req_ptr, bt_ptr, scale_ptr, out_ptr, lse_ptr,
    num_heads, num_reqs, topk, max_len, page_size, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cp, stride_cs, stride_kt, stride_bt,
    stride_ot, stride_oh, stride_lt,
    L: tl.constexpr, R: tl.constexpr, B_L: tl.constexpr, B_R: tl.constexpr, LAYOUT: tl.constexpr,
    DS_GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    DOT_DTYPE: tl.constexpr = qn_ptr.dtype.element_ty
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    pid = tl.program_id(0)
    tok = pid // head_blocks
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    cols_l = tl.arange(0, B_L)
    cols_r = tl.arange(0, B_R)

    qn = tl.load(qn_ptr + tok.to(tl.int64) * stride_qnt + heads[:, None] * stride_qnh + cols_l[None, :],
                 mask=head_ok[:, None] & (cols_l[None, :] < L), other=0.0)
    qp = tl.load(qp_ptr + tok.to(tl.int64) * stride_qpt + heads[:, None] * stride_qph + cols_r[None, :],
                 mask=head_ok[:, None] & (cols_r[None, :] < R), other=0.0)
    req = tl.load(req_ptr + tok)
    req = tl.where(req < 0, req + num_reqs, req)  # as the reference's torch indexing reads it
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    if LAYOUT == 1:
        kv_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale  # e4m3 values enter the dots unscaled

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, B_L], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    idx_ptr = topk_ptr + tok.to(tl.int64) * stride_kt + offs_n
    for start in range(0, topk, BLOCK_N):
        pos = tl.load(idx_ptr, mask=start + offs_n < topk, other=-1)
        in_table = (pos >= 0) & (pos < max_len)
        page = tl.load(bt_row + pos // page_size, mask=in_table, other=-1)
        valid = in_table & (page >= 0)
        rows = page.to(tl.int64) * stride_cp + (pos % page_size) * stride_cs
        kv_c, k_pe = _gather_rows(cache_ptr, rows, valid, cols_l, cols_r, L, R, B_L, B_R, LAYOUT, DS_GROUP,
                                  DOT_DTYPE)

        s = _dot(qn, tl.trans(kv_c), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), PRECISION, UPCAST)
        s = _dot(qp, tl.trans(k_pe), s, PRECISION, UPCAST)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A head that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(DOT_DTYPE), kv_c, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
        idx_ptr += BLOCK_N

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    if LAYOUT == 1:
        out = out * kv_scale
    # m + log2(l) is log2(sum exp); times ln 2 it is the natural log.
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptrs = out_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + cols_l[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (cols_l[None, :] < L))
    tl.store(lse_ptr + tok.to(tl.int64) * stride_lt + heads, lse, mask=head_ok)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def sparse_config(q_nope: torch.Tensor) -> dict:
    """The default launch config, from shapes and dtypes only.

    Hopper, 16-bit queries: 64 heads a program (one wgmma M tile; the two warpgroups of 8 warps
    split the 512 output columns, so the [64, 512] float32 accumulator costs 128 registers a
    thread; 128 heads would not fit), so H = 128 reads each selected row twice, the second time
    from L2. 32 keys a step and 2 stages keep Q (72 KB) plus two gathered [32, 576] tiles in
    ~150 KB of shared memory (the pipeliner spends the stages on the index -> page -> row chain).
    Fewer heads (H = 16) take 16-row tiles on 4 warps. float32 runs exact dots on small tiles,
    and so does the CPU interpreter.
    """
    num_heads = q_nope.shape[1]
    if q_nope.device.type != "cuda" or q_nope.dtype == torch.float32:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_h = min(64, _pow2(num_heads))
    # H200, T=4096, topk 2048, H=128: BLOCK_N 64 / 1 stage 15.7 ms, 32 / 2 stages 19.4 ms, 16: 28 ms.
    if block_h == 64:
        return {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1}
    return {"BLOCK_H": block_h, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def wgmma_blocks(q_nope: torch.Tensor, kv_cache: torch.Tensor, layout: str) -> str | None:
    """Why the Gluon form (:mod:`.sparse_wgmma`) cannot run this call (None: it can): what the
    Gluon kernels need (a bf16 cache, or fp8_ds through its own kernel), and 16-byte aligned
    cache rows (its copies move 16 bytes)."""
    latent = q_nope.shape[-1]
    if layout == "fp8_ds":  # rows of L e4m3 | L/128 float32 | R bf16: the widening kernel
        why = decode_stream.why_not(q_nope, kv_cache, layout, latent, q_pe_width(kv_cache, latent))
    else:
        why = decode_wgmma.why_not(q_nope, kv_cache, layout, latent, kv_cache.shape[-1] - latent)
    if why is None and (kv_cache.data_ptr() % 16 or kv_cache.stride(1) % 8 or kv_cache.stride(0) % 8):
        why = "cache rows are not 16-byte aligned (its copies move 16 bytes)"
    return why


def q_pe_width(kv_cache: torch.Tensor, latent: int) -> int:
    """An fp8_ds cache row's rope width: L e4m3 bytes, L/128 float32 scales, then bf16 values."""
    return (kv_cache.shape[-1] - latent - 4 * (latent // 128)) // 2


def sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale,
               config: dict | None = None):
    """Same arguments and results as ``torch.ops.mlagraph.sparse_mla`` (checked by the caller);
    ``config`` overrides :func:`sparse_config` (keys BLOCK_H, BLOCK_N, num_warps, num_stages, and
    FORM: "rows" for the Triton kernel here, "wgmma" for the Gluon one, :mod:`.sparse_wgmma`,
    which takes num_stages 1 or 2, or with SEESAW True the seesaw schedule, :mod:`.seesaw`)."""
    check_runnable("sparse_mla", _sparse_mla_kernel, q_nope)
    num_tokens, num_heads, latent = q_nope.shape
    rope = q_pe.shape[2]
    out = torch.empty((num_tokens, num_heads, latent), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q_nope.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    # The kernel addresses the last dim with unit stride.
    q_nope, q_pe, kv_cache, topk_indices, block_table = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q_nope, q_pe, kv_cache, topk_indices, block_table)
    )
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    if not config and num_heads > 16 and layout == "bf16" and wgmma_blocks(q_nope, kv_cache, layout) is None:
        # The Gluon form where it runs, past 16 heads (H200, 2026-12-07, T=4096 ctx=32K top-2048
        # H=128: 10.6 ms against this kernel's 15.9; at 16 heads it would pad 48 rows, untimed).
        config = {"FORM": "wgmma"}
    cfg = {**sparse_config(q_nope), **(config or {})}
    page_size = kv_cache.shape[1]
    if cfg.get("FORM", "rows") == "wgmma":
        return _sparse_wgmma(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, layout, softmax_scale,
                             config or {}, out, lse)
    if cfg.get("FORM", "rows") != "rows":
        raise ValueError(f"sparse_mla config: FORM must be 'rows' or 'wgmma', got {cfg['FORM']!r}")
    grid = (num_tokens * triton.cdiv(num_heads, cfg["BLOCK_H"]),)
    _sparse_mla_kernel[grid](
        q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table,
        scale if layout == "fp8" else lse,  # (a float32 stand-in; only "fp8" reads it)
        out, lse,
        num_heads, block_table.shape[0], topk_indices.shape[1], block_table.shape[1] * page_size, page_size,
        softmax_scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        topk_indices.stride(0), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        L=latent, R=rope, B_L=_pow2(latent), B_R=_pow2(rope), LAYOUT=_LAYOUT_IDS[layout], DS_GROUP=DS_GROUP,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_sparse_mla_kernel),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


def _sparse_wgmma(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, layout, softmax_scale, config, out, lse):
    """The Gluon form's launch (:mod:`.sparse_wgmma`): refused, with the reason, where it cannot run."""
    if layout == "fp8_ds" and set(config) - {"FORM"}:  # the widening kernel's pipeline is its own
        raise ValueError(f"sparse_mla config: FORM 'wgmma' with an fp8_ds cache takes no other keys, got "
                         f"{sorted(set(config) - {'FORM'})}")
    unknown = set(config) - {"FORM", "num_stages", "SEESAW"}
    if unknown:
        raise ValueError(f"sparse_mla config: FORM 'wgmma' takes only num_stages and SEESAW, got {sorted(unknown)}")
    stages = config.get("num_stages", 2)
    if config.get("SEESAW") and stages != 2:
        raise ValueError(f"sparse_mla config: SEESAW takes num_stages 2 (a pair of key blocks), got {stages}")
    why = wgmma_blocks(q_nope, kv_cache, layout)
    if why is not None:
        raise ValueError(f"sparse_mla config: FORM 'wgmma' asked for, but {why}")
    latent, rope = q_nope.shape[-1], q_pe.shape[-1]
    decode_wgmma.check_stages("sparse_mla", stages, latent, rope)
    num_tokens, num_heads = q_nope.shape[:2]
    page_size = kv_cache.shape[1]
    grid = (num_tokens * triton.cdiv(num_heads, sparse_wgmma.BLOCK_H),)
    args = (q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, out, lse,
            num_heads, block_table.shape[0], topk_indices.shape[1], block_table.shape[1] * page_size,
            softmax_scale * LOG2E,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            topk_indices.stride(0), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    if layout == "fp8_ds":  # the widening kernel, opt-in
        sparse_wgmma._sparse_ds_kernel[grid](*args, L=latent, R=rope, PAGE=page_size, num_warps=sparse_wgmma.NUM_WARPS)
    elif config.get("SEESAW"):  # the warp groups on alternate key blocks (seesaw.py), opt-in
        seesaw._sparse_kernel[grid](*args, L=latent, R=rope, PAGE=page_size, num_warps=seesaw.NUM_WARPS,
                                    maxnreg=seesaw.MAX_REGS)
    else:
        sparse_wgmma._sparse_wgmma_kernel[grid](*args, L=latent, R=rope, PAGE=page_size, STAGES=stages,
                                                num_warps=sparse_wgmma.NUM_WARPS)
    return out, lse
