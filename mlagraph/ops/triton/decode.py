"""Triton ``mla_decode``: absorbed MLA over the paged latent cache, split-KV (flash-decoding).

Math (see :mod:`mlagraph.ops.decode`): per request b and query row, with the latent kv_c both key
(with k_pe) and value,

    score = softmax_scale * (q_nope . kv_c + q_pe . k_pe),   out = softmax(score) @ kv_c.

Rows. The s_q queries x H heads of a request form M = s_q * H rows; row r is query i = r // H,
head h = r % H, at position ``seq_lens[b] - s_q + i``, and sees keys 0..that position (a per-row
causal limit). A program takes BLOCK_H rows at once, so every latent row it reads serves all of
them (H=128 -> two 64-row blocks, so each key is read twice, the second time mostly from L2).

Kernel 1 (``_split_kernel``), grid (row blocks, MAX_SPLITS, B), fixed from shapes only. Each
request's keys are cut on the device, from ``seq_lens[b]``, into at most MAX_SPLITS equal runs of
whole BLOCK_N blocks; a program whose run is empty writes only lse = -inf (and, with a single
split, out = 0). A program walks its
run BLOCK_N keys at a time: page ids from the block table (a -1 page or a position past the
length masks the key; masked rows load as 0, never as the cache's garbage), gathers the rows,
scores them with two tl.dot (latent 512 + rope 64, fp32 accumulation), and keeps an online
softmax in base 2 (log2(e) folded into the scale). Row blocks vary fastest in the grid so the
programs sharing one key run are launched together.

Kernel 2 (``_combine_kernel``), grid (M, B): merges a row's splits with log-sum-exp weights;
empty splits (lse = -inf) are never read, and a row with no key at all gets out 0, lse -inf.
With MAX_SPLITS = 1 there is nothing to merge: kernel 1 writes out and lse itself.

Cache layouts: ``bf16`` rows are read in the cache's dtype; ``fp8`` e4m3 bytes are widened (exact)
and the per-tensor scale is folded into the score scale and the output; ``fp8_ds`` e4m3 bytes are
multiplied by their group's float32 scale (one per 128 latent values) before the dot and the rope
part is bf16. On the GPU the dots run in q's dtype (bf16/fp16: p and fp8_ds's dequantized rows are
rounded to it; float32 queries use exact IEEE float32 dots), the softmax and accumulator in
float32. In the CPU interpreter every dot runs in float32 (its bf16 dot and bf16 rounding are
unreliable), so CPU results are the exact-arithmetic version of the GPU's.

The keys-major form (:mod:`.decode_keys`, config ``FORM="keys"``, optionally ``TMA=True``) puts
the keys on the MMA's M side for the memory-bound row counts. With TMA it is the default on
CUDA for bf16 caches at 32 rows or fewer whose 64-key blocks the copy engine can read whole
(:func:`default_config`), 16 or fewer where the Gluon form runs. The Gluon form
(:mod:`.decode_wgmma`, ``FORM="wgmma"``) is the default past 16 rows on Hopper for bf16 queries
and caches at DeepSeek's widths that the copy engine can read (:func:`wgmma_blocks`): its two
warp groups split the scores instead of both computing them. Other caches, fp8 layouts and other
GPUs run the rows form here.

Nothing here reads tensor values on the host, so a call can be captured in a CUDA graph.
:func:`default_config` picks block sizes and MAX_SPLITS from shapes; :func:`mla_decode_with_config`
takes an override for benchmark sweeps. L and R must be powers of two (DeepSeek: 512, 64).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._decode_tiles import (_block_rows, _dot, _kv_len, _load_latent, _load_rope, _normalizer, _query_rows,
                            _score_scales, _split_len, _split_run)
from . import decode_stream, decode_wgmma, seesaw
from .decode_keys import _split_keys_kernel
from .decode_keys_fp8 import _split_keys_fp8_kernel
from ._hardware import H200_SMS, hardware, interpreted
from ._launch import check_runnable

_LAYOUT_IDS = {"bf16": 0, "fp8": 1, "fp8_ds": 2}
# The Gluon form is the default past 16 rows where it runs (checked and timed on an H200,
# 2026-12-07); False leaves it to configs that ask for it (FORM "wgmma").
WGMMA_BY_DEFAULT = True
_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    q_nope, q_pe, cache, block_table, seq_lens, fp8_scale, out, lse,
    qk_scale,  # softmax_scale * log2(e)
    stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
    stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
    stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
    MAX_LEN,  # block_table.shape[1] * page_size: keys past it do not exist
    S_Q: tl.constexpr, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BL: tl.constexpr, BR: tl.constexpr,  # L and R rounded up to powers of two >= 16 (tl.dot's minimum)
    LAYOUT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr,  # MAX_SPLITS == 1: write the final out (q dtype) and lse, no combine
    F32: tl.constexpr,  # float32 dots: float32 queries, or the CPU interpreter (see the launcher)
    FP16: tl.constexpr,  # fp16 dots (fp8 caches: e4m3 -> fp16 is one hardware conversion, bf16 is not)
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    DOT_DTYPE: tl.constexpr = tl.float32 if F32 else (tl.float16 if FP16 else q_nope.dtype.element_ty)

    seq_len, lo, hi = _split_run(seq_lens, b, stride_sl, MAX_LEN, split, BLOCK_N, MAX_SPLITS)
    offs_m, row_ok, qi, qh, limit = _query_rows(row_block, seq_len, S_Q, H, BLOCK_H)
    offs_l = tl.arange(0, BL)
    offs_r = tl.arange(0, BR)
    qn = tl.load(q_nope + b * stride_qn_b + (qi * stride_qn_s + qh * stride_qn_h)[:, None] + offs_l[None, :],
                 mask=row_ok[:, None] & (offs_l[None, :] < L), other=0.0).to(DOT_DTYPE)
    qp = tl.load(q_pe + b * stride_qp_b + (qi * stride_qp_s + qh * stride_qp_h)[:, None] + offs_r[None, :],
                 mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0).to(DOT_DTYPE)

    scale, out_scale = _score_scales(fp8_scale, qk_scale, LAYOUT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BL], tl.float32)
    bt_row = block_table + b * stride_bt_b
    for start in range(lo, hi, BLOCK_N):
        pos, valid, rows = _block_rows(cache, bt_row, start, hi, stride_bt_p, stride_c_page, stride_c_tok, PAGE,
                                       BLOCK_N)
        kv = _load_latent(rows, valid, L, BL, LAYOUT, BLOCK_N, DOT_DTYPE, "evict_last")
        pe = _load_rope(rows, valid, L, R, BR, LAYOUT, DOT_DTYPE)
        if LAYOUT == 0 and cache.dtype.element_ty == DOT_DTYPE:
            kv_v = kv  # one tile in shared memory serves both dots
        else:
            # The same rows again, for the values (an L2 hit). A converted tile (fp8 widened or
            # dequantized) feeds the two dots through different layouts, and Triton does not
            # pipeline a load used that way; two loads of one use each are both pipelined
            # (checked in the sm_90 TTGIR). The different eviction hints keep CSE from merging them.
            kv_v = _load_latent(rows, valid, L, BL, LAYOUT, BLOCK_N, DOT_DTYPE, "")

        s = _dot(qp, tl.trans(pe), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), F32)
        s = _dot(qn, tl.trans(kv), s, F32) * scale
        visible = valid[None, :] & (pos[None, :] <= limit[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(DOT_DTYPE), kv_v, acc * alpha[:, None], F32)
        m_i = m_new

    factor, row_lse = _normalizer(m_i, l_i, out_scale)
    o = acc * factor[:, None]
    o_ptrs = out + b * stride_o_b + split * stride_o_split + offs_m[:, None] * stride_o_row + offs_l[None, :]
    col_ok = offs_l[None, :] < L
    if DIRECT:
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok)
    else:  # an empty split leaves its partial out unwritten: the combine never reads it
        # (lo < hi broadcast to a vector before the &: the interpreter mis-types bool & scalar)
        nonempty = tl.full([BLOCK_H], lo, lo.dtype) < hi
        tl.store(o_ptrs, o, mask=(row_ok & nonempty)[:, None] & col_ok)
    tl.store(lse + b * stride_lse_b + split * stride_lse_split + offs_m, row_lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    part_out, part_lse, out, lse, seq_lens, stride_sl, MAX_LEN,
    stride_po_b, stride_po_split, stride_pl_b, stride_pl_split, stride_o_b, stride_lse_b,
    L: tl.constexpr, BL: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_len = _kv_len(tl.load(seq_lens + b * stride_sl), MAX_LEN)
    # Splits past the request's last non-empty one hold lse = -inf; do not even visit them.
    n_splits = tl.cdiv(kv_len, tl.maximum(_split_len(kv_len, BLOCK_N, MAX_SPLITS), 1))

    lse_row = part_lse + b * stride_pl_b + row
    offs_s = tl.arange(0, SPLITS_P2)
    lses = tl.load(lse_row + offs_s * stride_pl_split, mask=offs_s < n_splits, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lses - m_safe), 0)

    offs_l = tl.arange(0, BL)
    col_ok = offs_l < L
    acc = tl.zeros([BL], tl.float32)
    po_row = part_out + b * stride_po_b + row * L + offs_l
    for s in range(0, n_splits):
        lse_s = tl.load(lse_row + s * stride_pl_split)
        has_keys = (tl.full([BL], lse_s, tl.float32) > float("-inf")) & col_ok  # a vector mask (see above)
        o = tl.load(po_row + s * stride_po_split, mask=has_keys, other=0.0)
        acc += tl.exp(lse_s - m_safe) * o
    has_key = total > 0.0
    res = acc / tl.where(has_key, total, 1.0)
    tl.store(out + b * stride_o_b + row * L + offs_l, res.to(out.dtype.element_ty), mask=col_ok)
    tl.store(lse + b * stride_lse_b + row, tl.where(has_key, m_safe + tl.log(tl.where(has_key, total, 1.0)),
                                                    float("-inf")))


# ---------------------------------------------------------------------------------------------
# configuration


def _num_sms(device: torch.device) -> int:
    if interpreted(_split_kernel):
        return 4  # the CPU interpreter runs programs one by one: a few splits at most
    return hardware(device).num_sms


def _pick_splits(base: int, slots: int, cap: int) -> int:
    """Splits per request: the fewest that fill the machine's CTA slots about as evenly as the
    best choice (a wave-quantization rule as in FlashAttention's split heuristic)."""
    def efficiency(s: int) -> float:
        waves = base * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, cap + 1))
    return next(s for s in range(1, cap + 1) if efficiency(s) >= 0.85 * best)


def default_config(batch: int, rows: int, max_len: int, kv_lora_rank: int, layout: str, q_dtype: torch.dtype,
                   num_sms: int = H200_SMS, keys_tma: bool = False, wgmma: bool = False) -> dict:
    """Block sizes, warps, stages and MAX_SPLITS from shapes only (numbers from compiling for
    sm_90 offline: registers, spills, shared memory; not yet timed). ``keys_tma``: the copy
    engine can read this cache's 64-key blocks whole (:func:`tma_blocks`); ``wgmma``: the Gluon
    form runs here (:func:`wgmma_blocks` found nothing against it).

    - wgmma, more than 16 rows: the Gluon form (:mod:`.decode_wgmma`), 64 rows and 64 keys a
      block, 8 warps, 2 stages (224 KB of shared memory at L=512: one CTA an SM); splits by the
      wave rule over one CTA an SM, each split at least 2 key blocks. H200, 2026-12-07, B=128
      L=4096 (2 splits past 32 rows then): H=128 404 us (rows form 690, FlashMLA 224), H=64 212
      (rows 364), H=32 186 and H=24 192 (keys form 221 / 222). H100, same day, one split (the
      wave rule's pick): H=128 370 us (FlashMLA 239), L=1151 132 (FlashMLA 80).

    - keys_tma, a bf16 cache, 32 rows or fewer (H=16 at s_q 1, a TP shard's heads; 16 or fewer
      where the Gluon form runs), bf16 or fp16 queries: the keys-major form (:mod:`.decode_keys`) with TMA, BLOCK_N 64, 4 warps, 2
      stages (no spill, ~186-225 KB of shared memory: one CTA an SM); splits: one a key block
      where the SMs hold them all (a lone request), else by the wave rule over one CTA an SM.
      H100, 2026-12-07, B=128 L=4096: 216 us at s_q 1 (rows form 254), 246 at s_q 2 (rows
      346); B=64 L=16384: 419 (rows 471), 2 splits (1 split: 728).

    - BLOCK_H: all of a request's rows (s_q * H) in one block, up to 64 (H=128: two blocks).
    - 64 rows (compute-bound): 8 warps, the float32 accumulator [64, 512] split over both warp
      groups (128 registers a thread); BLOCK_N 32, 2 stages: q 74 KB + 2 x 37 KB key tiles in
      shared memory (~147 KB bf16, ~177 KB fp8_ds), 255 registers, a few bytes of spill.
      Triton gives a chained dot's warps all to its rows, so at 64 rows both warp groups compute
      the same q.k scores (the latent half of the FLOPs twice); BLOCK_N 64 halves the number
      of score MMAs but needs ~221 KB of shared memory at 2 stages.
    - fewer rows (memory-bound, H=16): 8 warps over BLOCK_N 64 keys (one 8-key MMA column slice
      a warp: no duplicated scores), no spills; ~92 KB shared memory, 128 registers (bf16: two
      CTAs an SM), 195-254 registers for the fp8 layouts (one CTA).
    - MAX_SPLITS: enough (request, row block, split) programs to fill the SMs' CTA slots evenly,
      each split at least 2 key blocks, at most 64 splits.
    - float32 queries (tests, float32 models) run exact IEEE float32 dots: small blocks.
    """
    fp32 = q_dtype == torch.float32
    if wgmma and rows > 16:
        return _wgmma_config(batch, rows, max_len, num_sms)
    block_h = min(16 if fp32 else 64, max(16, triton.next_power_of_2(rows)))
    if keys_tma and layout == "bf16" and not fp32 and rows <= 32:
        return _keys_tma_config(batch, rows, max_len, num_sms)
    if fp32:
        block_n, num_warps, num_stages, ctas_per_sm = 16, 4, 1, 1
    elif block_h >= 64:
        # H200, B=128, L=4096, H=128 bf16: BLOCK_N 64 / 2 stages 692 us, 32 / 2 stages 972 us,
        # 16: 1517 us. The fp8 layouts load each tile twice (see the kernel): 64 keys would
        # need 283 KB of shared memory, so they keep 32.
        block_n = 64 if layout == "bf16" else 32
        num_warps, num_stages, ctas_per_sm = 8, 2, 1
    else:
        # H200, H=16, B=128, L=4096 bf16: BLOCK_N 32 / 4 warps 232 us, 64 / 8 warps 295 us.
        block_n, num_warps, num_stages, ctas_per_sm = 32, 4, 2, 2 if layout == "bf16" else 1
    row_blocks = triton.cdiv(rows, block_h)
    cap = max(1, min(64, triton.cdiv(max_len, block_n) // 2))
    max_splits = _pick_splits(max(1, batch * row_blocks), num_sms * ctas_per_sm, cap)
    if block_h < 64 and not fp32:
        # Memory-bound rows: more splits than the wave rule asks for kept more loads in flight
        # (H200, H=16, B=128, L=4096: 4 splits 234 us bf16 / 269 us fp8, 2 splits 337 / 368 us).
        max_splits = max(max_splits, min(4, cap))
    # fp8 caches: e4m3 -> fp16 is one conversion instruction (bf16 is not), and fp16 keeps
    # 3 more mantissa bits of q (H200, H=16 fp8: relative error 3.4e-4 vs 1.0e-3 in bf16).
    fp16_dot = layout != "bf16" and q_dtype == torch.bfloat16
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "MAX_SPLITS": max_splits, "FP16_DOT": fp16_dot, "FORM": "rows", "TMA": False}


def _keys_tma_config(batch: int, rows: int, max_len: int, num_sms: int) -> dict:
    """The keys-major TMA form's config (see :func:`default_config`), its Gluon twin's too."""
    cap = max(1, min(64, triton.cdiv(max_len, 64)))
    # few requests: a split per key block, if the SMs hold them (B=1 L=1024: 16 splits)
    splits = cap if batch * cap <= num_sms else _pick_splits(batch, num_sms, cap)
    return {"BLOCK_H": max(16, triton.next_power_of_2(rows)), "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
            "MAX_SPLITS": splits, "FP16_DOT": False, "FORM": "keys", "TMA": True}


def _wgmma_config(batch: int, rows: int, max_len: int, num_sms: int) -> dict:
    """The Gluon form's config (see :func:`default_config`)."""
    cap = max(1, min(64, triton.cdiv(max_len, decode_wgmma.BLOCK_N) // 2))
    # The wave rule alone. An H100 run of 2026-12-07 timed the single split it picks at H=128,
    # B=128 against the 2 splits an earlier rule forced past 32 rows: L=4096 370 / 415 us (s_q
    # 2: 726 / 797), L=1151 132 / 177.
    splits = _pick_splits(batch * triton.cdiv(rows, decode_wgmma.BLOCK_H), num_sms, cap)
    return {"BLOCK_H": decode_wgmma.BLOCK_H, "BLOCK_N": decode_wgmma.BLOCK_N, "num_warps": decode_wgmma.NUM_WARPS,
            "num_stages": 2, "MAX_SPLITS": splits, "FP16_DOT": False, "FORM": "wgmma", "TMA": True}


def _dot_width(dim: int) -> int:
    """A head dim rounded up to what tl.arange and tl.dot take (DeepSeek's 512 and 64 already are)."""
    return max(16, triton.next_power_of_2(dim))


def _check_config(config: dict, override: dict) -> None:
    unknown = set(override) - {"BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "MAX_SPLITS", "FP16_DOT", "FORM", "TMA",
                               "OVERLAP", "SEESAW", "WS"}
    if unknown:
        raise ValueError(f"mla_decode config: unknown keys {sorted(unknown)}")
    for key in ("BLOCK_H", "BLOCK_N"):
        v = config[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"mla_decode config: {key} must be a power of two >= 16, got {v}")
    if config["MAX_SPLITS"] < 1:
        raise ValueError(f"mla_decode config: MAX_SPLITS must be >= 1, got {config['MAX_SPLITS']}")
    if config["FORM"] not in ("rows", "keys", "wgmma"):
        raise ValueError(f"mla_decode config: FORM must be 'rows', 'keys' or 'wgmma', got {config['FORM']!r}")
    if config["FORM"] == "wgmma":
        fixed = {"BLOCK_H": decode_wgmma.BLOCK_H, "BLOCK_N": decode_wgmma.BLOCK_N, "num_warps": decode_wgmma.NUM_WARPS,
                 "FP16_DOT": False, "TMA": True}
        for key, want in fixed.items():
            if config[key] != want:
                raise ValueError(f"mla_decode config: FORM 'wgmma' takes {key} {want}, got {config[key]}")
        if config["num_stages"] < 1:
            raise ValueError(f"mla_decode config: FORM 'wgmma' needs num_stages >= 1, got {config['num_stages']}")
        if config.get("OVERLAP") and config["num_stages"] < 2:
            # the next block's scores read its stage while this block's P @ kv reads this one
            raise ValueError(f"mla_decode config: OVERLAP needs num_stages >= 2, got {config['num_stages']}")
        if config.get("SEESAW") and (config.get("OVERLAP") or config["num_stages"] != 2):
            # its schedule is its own: two key blocks (a pair) in flight, refilled part by part
            raise ValueError(f"mla_decode config: SEESAW takes num_stages 2 and no OVERLAP, got num_stages "
                             f"{config['num_stages']}, OVERLAP {bool(config.get('OVERLAP'))}")
        return
    if config.get("SEESAW"):
        raise ValueError("mla_decode config: SEESAW needs FORM 'wgmma'")
    if config.get("WS"):
        # the Gluon keys form (decode_stream): its fixed block, up to 32 rows, TMA (its slots are
        # checked against shared memory at the launch, where the layout is known)
        want = {"FORM": "keys", "TMA": True, "BLOCK_N": decode_stream.BLOCK_N}
        for key, value in want.items():
            if config[key] != value:
                raise ValueError(f"mla_decode config: WS takes {key} {value}, got {config[key]}")
        if config["BLOCK_H"] > 32:
            raise ValueError(f"mla_decode config: WS takes BLOCK_H <= 32, got {config['BLOCK_H']}")
    if config.get("OVERLAP"):
        raise ValueError("mla_decode config: OVERLAP needs FORM 'wgmma'")
    if config["TMA"] and config["FORM"] != "keys":
        raise ValueError("mla_decode config: TMA needs FORM 'keys' (or 'wgmma', always through the copy engine)")
    if config["TMA"] and config["num_stages"] < 2:
        # Not pipelined, the copies run inside the loop; with a bf16 cache that gave wrong
        # outputs on an H100 (Triton 3.6, 2026-12-07), so it is refused rather than guessed at.
        raise ValueError(f"mla_decode config: TMA needs num_stages >= 2, got {config['num_stages']}")


def tma_blocks(kv_cache: torch.Tensor, latent: int, rope: int, block_n: int) -> str | None:
    """Why the copy engine cannot read this cache's key blocks whole (None: it can): the
    keys-major kernel's TMA loads take BLOCK_N rows of one page as one box."""
    _, page_size, width = kv_cache.shape
    if kv_cache.device.type == "cuda" and torch.cuda.get_device_capability(kv_cache.device) < (9, 0):
        return "the device has no tensor memory accelerator (sm_90+)"
    if latent != _dot_width(latent) or rope != _dot_width(rope):
        return f"kv_lora_rank {latent} / rope dim {rope} are not powers of two >= 16"
    if page_size % block_n:
        return f"page_size {page_size} is not a multiple of BLOCK_N {block_n}"
    if kv_cache.stride() != (page_size * width, width, 1):
        return f"the cache's pages are not back to back (strides {kv_cache.stride()})"
    if kv_cache.data_ptr() % 16 or (width * kv_cache.element_size()) % 16:
        return "cache rows are not 16-byte aligned"
    return None


def wgmma_blocks(q_nope: torch.Tensor, kv_cache: torch.Tensor, layout: str, latent: int, rope: int) -> str | None:
    """Why the Gluon form (:mod:`.decode_wgmma`) cannot run this call (None: it can): what the
    Gluon kernels need, and 64-key blocks the copy engine can read whole."""
    return (decode_wgmma.why_not(q_nope, kv_cache, layout, latent, rope)
            or tma_blocks(kv_cache, latent, rope, decode_wgmma.BLOCK_N))


def _cache_descriptors(kv_cache: torch.Tensor, layout: str, latent: int, rope: int, block_n: int):
    """(latent, rope) tensor descriptors over the cache's rows [pages * page_size, W]: boxes of
    block_n rows (see decode_keys). Out-of-bounds rows (a -1 page) read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    if layout == "bf16":
        lat = TensorDescriptor.from_tensor(rows, [block_n, latent])
        return lat, TensorDescriptor.from_tensor(rows, [block_n, rope])
    # fp8 layouts: the latent's bytes in four column chunks (decode_keys_fp8); fp8_ds's scales
    # are read with plain loads, its rope as bf16 (656-byte rows).
    lat = TensorDescriptor.from_tensor(rows, [block_n, latent // 4])
    pe = rows if layout == "fp8" else rows.view(torch.bfloat16)
    return lat, TensorDescriptor.from_tensor(pe, [block_n, rope])


# ---------------------------------------------------------------------------------------------
# entry points


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale):
    """The triton backend's ``mla_decode`` (arguments already checked by the generic op's check)."""
    return mla_decode_with_config(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)


def _launch_config(q_nope, kv_cache, layout: str, batch: int, rows: int, max_len: int, rope: int,
                   config: dict) -> dict:
    """The config a call runs: the form (the keys-major TMA form up to 32 rows and the Gluon form
    past 16 where they apply and the caller picked no form; the Gluon form at any row count
    where asked for), its defaults, then the caller's overrides, checked."""
    latent = q_nope.shape[-1]
    picked = {"FORM", "TMA"} & set(config)
    on_gpu = q_nope.device.type == "cuda"
    if config.get("WS"):  # the keys form's Gluon twin, any layout: where it cannot run, say why
        why = (decode_stream.why_not(q_nope, kv_cache, layout, latent, rope)
               or tma_blocks(kv_cache, latent, rope, decode_stream.BLOCK_N))
        if why is not None:
            raise ValueError(f"mla_decode config: WS asked for, but {why}")
        cfg = _keys_tma_config(batch, rows, max_len, _num_sms(q_nope.device))
        cfg["num_stages"] = decode_stream.pick_stages(cfg["BLOCK_H"], latent, rope, layout)
        cfg.update(config)
        _check_config(cfg, config)
        decode_stream.check_stages(cfg["BLOCK_H"], latent, rope, layout, cfg["num_stages"])
        return cfg
    keys_tma = (on_gpu and layout == "bf16" and rows <= 32 and not picked
                and tma_blocks(kv_cache, latent, rope, 64) is None)
    asked = config.get("FORM") == "wgmma"
    wgmma = asked or (WGMMA_BY_DEFAULT and not picked and rows > 16 and on_gpu)
    if wgmma:
        why = wgmma_blocks(q_nope, kv_cache, layout, latent, rope)
        if why is not None and asked:
            raise ValueError(f"mla_decode config: FORM 'wgmma' asked for, but {why}")
        wgmma = why is None
    if asked:  # at any row count (<= 32 rows pad the 64-row block)
        cfg = _wgmma_config(batch, rows, max_len, _num_sms(q_nope.device))
    else:
        cfg = default_config(batch, rows, max_len, latent, layout, q_nope.dtype, _num_sms(q_nope.device), keys_tma,
                             wgmma)
    cfg.update(config)
    if cfg["TMA"] and cfg["FORM"] == "keys" and "num_stages" not in config:
        cfg["num_stages"] = max(2, cfg["num_stages"])  # TMA copies run pipelined (see _check_config)
    _check_config(cfg, config)
    if cfg["FORM"] == "keys" and layout != "bf16" and (_dot_width(latent) < 64 or layout == "fp8_ds" and latent > 512):
        # decode_keys_fp8 reads the latent in four chunks of at least 16 columns, and an fp8_ds
        # chunk must lie inside one 128-column scale group.
        raise ValueError(f"mla_decode config: FORM 'keys' with a {layout!r} cache needs kv_lora_rank "
                         f"{'64..512' if layout == 'fp8_ds' else '>= 64'}, got {latent}")
    return cfg


def mla_decode_with_config(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale,
                           config: dict | None = None):
    """:func:`mla_decode` with optional overrides of :func:`default_config`'s keys (BLOCK_H,
    BLOCK_N, num_warps, num_stages, MAX_SPLITS, FP16_DOT, FORM "rows" | "keys" | "wgmma", TMA, and
    for the Gluon form OVERLAP (block j+1's scores issued before block j's P @ kv ends) or SEESAW
    (the two warp groups on alternate blocks, :mod:`.seesaw`); WS for the keys form: its Gluon
    twin with a loader warp, :mod:`.decode_stream`); the keys not
    given keep their default. TMA where the cache's blocks cannot be copied whole is refused
    (:func:`tma_blocks` says why)."""
    check_runnable("mla_decode", _split_kernel, q_nope)
    # CPU tensors run in Triton's interpreter, whose tl.dot garbles bfloat16 operands and whose
    # float32 -> bfloat16 conversion truncates: there the dots run in float32 (F32) instead.
    batch, s_q, heads, latent = q_nope.shape
    rope = q_pe.shape[-1]
    if layout == "fp8_ds" and latent & (latent - 1):
        raise ValueError(f"mlagraph_triton.mla_decode: kv_lora_rank must be a power of two for 'fp8_ds', got {latent}")
    rows = s_q * heads
    page_size = kv_cache.shape[1]
    max_len = block_table.shape[1] * page_size
    out = torch.empty((batch, s_q, heads, latent), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((batch, s_q, heads), dtype=torch.float32, device=q_nope.device)
    if batch == 0 or rows == 0:
        return out, lse

    cfg = _launch_config(q_nope, kv_cache, layout, batch, rows, max_len, rope, config or {})
    block_h, block_n, max_splits = cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["MAX_SPLITS"]

    if kv_cache.stride(-1) != 1:  # rows are read as contiguous runs of bytes / values
        kv_cache = kv_cache.contiguous()
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    direct = max_splits == 1
    if direct:
        part_out, part_lse = out.view(batch, 1, rows, latent), lse.view(batch, 1, rows)
    else:
        part_out = torch.empty((batch, max_splits, rows, latent), dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty((batch, max_splits, rows), dtype=torch.float32, device=q_nope.device)

    grid = (triton.cdiv(rows, block_h), max_splits, batch)
    common = (
        softmax_scale * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), block_table.stride(1), seq_lens.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        max_len,
    )
    meta = dict(
        S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page_size, BL=_dot_width(latent), BR=_dot_width(rope),
        LAYOUT=_LAYOUT_IDS[layout], BLOCK_H=block_h,
        BLOCK_N=block_n, MAX_SPLITS=max_splits, DIRECT=direct,
        F32=q_nope.dtype == torch.float32 or q_nope.device.type == "cpu", FP16=bool(cfg["FP16_DOT"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    fp8_scale = scale if layout == "fp8" else None
    if cfg["FORM"] == "wgmma" and cfg.get("SEESAW"):
        descs = seesaw.cache_descriptors(kv_cache, latent, rope)
        seesaw._dense_kernel[grid](
            q_nope, q_pe, kv_cache, *descs, block_table, seq_lens, part_out, part_lse, *common,
            S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page_size, MAX_SPLITS=max_splits, DIRECT=direct,
            num_warps=seesaw.NUM_WARPS, maxnreg=seesaw.MAX_REGS)
    elif cfg["FORM"] == "wgmma":
        decode_wgmma.check_stages("mla_decode", cfg["num_stages"], latent, rope)
        descs = decode_wgmma.cache_descriptors(kv_cache, latent, rope)
        decode_wgmma._split_wgmma_kernel[grid](
            q_nope, q_pe, kv_cache, *descs, block_table, seq_lens, part_out, part_lse, *common,
            S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page_size, MAX_SPLITS=max_splits, DIRECT=direct,
            STAGES=cfg["num_stages"], OVERLAP=bool(cfg.get("OVERLAP", False)), num_warps=decode_wgmma.NUM_WARPS)
    elif cfg.get("WS"):  # (where it runs and its slots: checked in _launch_config)
        descs = decode_stream.cache_descriptors(kv_cache, layout, latent, rope)
        shape = dict(S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page_size, BLOCK_H=block_h, MAX_SPLITS=max_splits,
                     DIRECT=direct, num_warps=decode_stream.NUM_WARPS)
        if layout == "bf16":
            decode_stream._stream_kernel[grid](q_nope, q_pe, kv_cache, *descs, block_table, seq_lens, part_out,
                                               part_lse, *common, **shape)
        else:
            decode_stream._stream_fp8_kernel[grid](
                q_nope, q_pe, kv_cache, *descs, block_table, seq_lens, scale if layout == "fp8" else part_lse,
                part_out, part_lse, *common, LAYOUT=_LAYOUT_IDS[layout], NS=cfg["num_stages"], **shape)
    elif cfg["FORM"] == "rows":
        _split_kernel[grid](q_nope, q_pe, kv_cache, block_table, seq_lens, fp8_scale, part_out, part_lse,
                            *common, **meta)
    else:
        descs = (None, None)
        if cfg["TMA"]:
            why = tma_blocks(kv_cache, latent, rope, block_n)
            if why is not None:
                raise ValueError(f"mla_decode config: TMA asked for, but {why}")
            descs = _cache_descriptors(kv_cache, layout, latent, rope, block_n)
        kernel = _split_keys_kernel if layout == "bf16" else _split_keys_fp8_kernel
        kernel[grid](q_nope, q_pe, kv_cache, *descs, block_table, seq_lens, fp8_scale, part_out, part_lse, *common,
                     TMA=bool(cfg["TMA"]), **meta)
    if not direct:
        _combine_kernel[(rows, batch)](
            part_out, part_lse, out, lse, seq_lens, seq_lens.stride(0), max_len,
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
            rows * latent, rows,
            L=latent, BL=_dot_width(latent), BLOCK_N=block_n, MAX_SPLITS=max_splits, SPLITS_P2=triton.next_power_of_2(max_splits),
            num_warps=4,
        )
    return out, lse
