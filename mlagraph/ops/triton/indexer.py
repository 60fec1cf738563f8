"""Triton kernels for the DSA lightning indexer: the key-cache write and the top-k selection.

Contracts: :mod:`mlagraph.ops.indexer`; cache bytes: :mod:`mlagraph.ops.layouts`.

``indexer_cache_write`` (grid ``[cdiv(T, ROWS)]``): each program quantizes ROWS keys and writes
them to their slots (slot -1: masked off). "bf16" rows are k cast to the cache dtype; "fp8" rows
are D e4m3 bytes of ``k / scale`` followed by the 4 bytes of ``scale = max(amax / 448, 1e-10)``.
Both divisions use ``tl.math.div_rn`` (a plain ``/`` is an approximate division on the GPU) and
e4m3 rounding goes through :mod:`._fp8`, so the bytes equal the reference writer's.

``indexer_topk`` runs in two stages over a float32 scores buffer ``[T, W]``, W = max(S, topk),
S = block_table.shape[1] * page_size (shapes only, so nothing depends on data):

1. ``_logits_kernel``, grid ``[cdiv(T, BLOCK_T), splits]``. A program takes BLOCK_T consecutive
   tokens and one split: a share of the key blocks (BLOCK_N positions each) up to the tokens'
   last visible position, divided in the kernel, so the work follows the actual context
   lengths rather than the block table's width. The tokens of one request
   share a key block: one ``tl.dot`` of keys [BLOCK_N, D] with the tokens' queries
   [D, BLOCK_T * Hi] scores them all (decode, one token per request, uses BLOCK_T = 1). A group
   whose tokens belong to several requests loops over those requests (a device-side loop; the
   common batch layout, each request's tokens back to back, needs one or two rounds). Per key:
   page lookup in the block table, dot, relu, times the head weights, sum over heads, times the
   fp8 row scale (a positive factor of the whole dot, so it commutes with relu and the sum);
   invisible keys (position > positions[t], a -1 page, a column >= S) get -inf. Key blocks past
   the group's last visible position are never loaded: they are filled with -inf when the
   selection is torch.topk (which reads whole rows, W >= topk columns), else left unwritten.
2. Selection of the topk best columns of each row, one of:
   - "triton" (default): ``_select_kernel``, one program per row, reading only the columns
     0..min(positions[t], S - 1) (so its cost follows the context, not the block table's
     width). Scores map to uint32 keys of the same order; the k-th largest key is found bit by
     bit from the top (32 counting passes over the row, held in registers when it fits in
     ``max_tile`` columns, else re-read in chunks from L1/L2), then one pass compacts the
     winners (every key above it, then the first ones equal to it) into a scratch row as
     (key << 32 | column) int64, and a bitonic ``tl.sort`` orders them by descending score.
   - "torch": ``torch.topk`` over the -inf-filled rows (sync-free and capturable as well); also
     used for topk > max_sort (4096), where the in-register sort would spill.
   Either way picks of -inf become -1 (fewer visible keys than topk). The order among equal
   scores is unspecified.

Memory floor (what "within 2x of the floor" is measured against), per call:

    bytes = sum_t n_keys(t) * row_bytes + T * Hi * (D * q_bytes + 4) + T * topk * 4

with row_bytes = D + 4 = 132 (fp8) or 2 * D = 256 (bf16), n_keys(t) the keys token t can see
(for a batch of one decode token per request: sum over requests of their lengths; prefill
tokens of one request share reads, so there count each request's keys once). Example: decode,
128 requests of 32K fp8 keys: 553 MB, 130 us at the H200's 4.25 TB/s copy rate. On top, the
scores round trip costs 8 B per (token, visible key) (written once, read once by the
selection, whose later passes hit registers or L1): 6% of an fp8 key's 132 B. Compute:
2 * Hi * D FLOPs per (token, key), 124 FLOP per fp8 key byte at Hi = 64, D = 128, close to the
H200's bf16 ridge (~160): decode at 32K is near both limits; prefill is compute-bound.

Stage 1's work per key block (sm_90 build): one page lookup when page_size is a multiple of
BLOCK_N (a division per key was half the loop), 32-bit key offsets from the block's first row,
and fp8 keys widened to fp16 for a dot with q scaled by a power of two into fp16's range
(``_into_fp16``; ``fp16_dots=False`` widens to bf16 instead): 363 instructions a 64-key block,
was 1,032.

Stage 1's loads: by default Triton's pipeliner prefetches the key blocks; ``prefetch=True``
instead loads block j + 1 into registers before block j is scored (an H100 run of 2026-12-07
had the default's scores stage at 523 of the op's 597 us, 1.06 TB/s; built for sm_90 offline,
the pipeliner gives these register-consumed fp8 loads two copy buffers at 5 stages and one at
3, so a program has at most about one block in flight).

Config: every heuristic choice is in :class:`IndexerConfig`; ``indexer_topk(..., config=...)``
and ``indexer_cache_write(..., config=...)`` take an override for benchmark sweeps.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._fp8 import from_fp8_bits, to_fp8_bits
from ._hardware import hardware, interpreted
from ._launch import check_runnable

_INT_MAX: tl.constexpr = tl.constexpr(2**31 - 1)  # no request has this id


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Launch choices; None = the shape heuristic. ``block_t``, ``block_n`` powers of two."""

    block_t: int | None = None  # tokens per logits program (1 for decode, up to 4 for prefill)
    block_n: int | None = None  # keys per block
    splits: int | None = None  # programs along the key axis per token group
    min_blocks: int = 4  # fewest key blocks a split takes (fewer splits run for short contexts)
    num_warps: int | None = None
    num_stages: int | None = None
    fp16_dots: bool = True  # fp8 keys: e4m3 -> fp16 (one hardware conversion a pair) and q
    # scaled by a power of two into fp16 (exact), instead of e4m3 -> float32 -> q's bf16
    prefetch: bool = False  # scores: load the next key block into registers before scoring
    # this one (a fixed prefetch distance of one block) instead of Triton's pipeliner
    topk_impl: str = "triton"  # "triton" (_select_kernel) or "torch" (torch.topk)
    max_sort: int = 4096  # a larger topk than this (next power of two) uses torch.topk
    max_tile: int = 32768  # longest row the selection keeps in registers (16 warps)
    select_chunk: int = 4096  # columns per step when the selection streams a row
    max_scores: int = 2**26  # float32 elements of scores per launch (tokens are chunked)
    write_rows: int | None = None  # keys per indexer_cache_write program
    poison_scores: bool = False  # tests: NaN-fill the scores first, so a read of a column no
    # kernel wrote shows up as a NaN pick




def _pow2_at_least(n: int, low: int = 1) -> int:
    return max(low, triton.next_power_of_2(max(1, n)))


# ---------------------------------------------------------------------------------------------
# indexer_cache_write


@triton.jit
def _round_to_bf16_grid(x):
    """float32 -> the nearest bfloat16 value (ties to even), still float32. Triton's interpreter
    truncates in float32 -> bfloat16 conversions; after this they are exact everywhere."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)  # NaN stays NaN


@triton.jit
def _cache_write_kernel(
    k_ptr, cache_ptr, slot_ptr, T, D,
    sk_t, sk_d, s_slot, sc_slot, sc_d,
    FP8: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t * s_slot, mask=t < T, other=-1).to(tl.int64)
    ok = slot >= 0  # slot -1: padding, nothing written
    dm = d < D
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * sk_t + d[None, :] * sk_d, mask=ok[:, None] & dm[None, :], other=0.0)
    row = cache_ptr + slot * sc_slot  # [ROWS] row starts
    if FP8:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # masked lanes are 0
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-10)
        vals = to_fp8_bits(tl.math.div_rn(x, scale[:, None]))
        tl.store(row[:, None] + d[None, :] * sc_d, vals, mask=ok[:, None] & dm[None, :])
        bits = scale.to(tl.int32, bitcast=True)  # little-endian float32 after the D values
        for i in tl.static_range(4):
            tl.store(row + (D + i) * sc_d, ((bits >> (8 * i)) & 255).to(tl.uint8), mask=ok)
    else:
        if cache_ptr.dtype.element_ty == tl.bfloat16:
            x = _round_to_bf16_grid(x.to(tl.float32))
        tl.store(row[:, None] + d[None, :] * sc_d, x.to(cache_ptr.dtype.element_ty), mask=ok[:, None] & dm[None, :])


def indexer_cache_write(k, k_cache, slot_mapping, layout, config: IndexerConfig | None = None) -> None:
    check_runnable("indexer_cache_write", _cache_write_kernel, k)
    num_tokens, head_dim = k.shape
    if num_tokens == 0:
        return None
    cfg = config or IndexerConfig()
    block_d = _pow2_at_least(head_dim, 16)
    rows = cfg.write_rows or max(1, min(16, 2048 // block_d, triton.next_power_of_2(num_tokens)))
    # uint8 for fp8 rows (the checks guarantee it); the model dtype for bf16 rows.
    cache = k_cache.view(torch.uint8) if layout == "fp8" else k_cache
    _cache_write_kernel[(triton.cdiv(num_tokens, rows),)](
        k, cache, slot_mapping, num_tokens, head_dim,
        k.stride(0), k.stride(1), slot_mapping.stride(0), cache.stride(1), cache.stride(2),
        FP8=layout == "fp8", ROWS=rows, BLOCK_D=block_d, num_warps=4,
    )
    return None


# ---------------------------------------------------------------------------------------------
# indexer_topk, stage 1: scores


@triton.jit
def _flat(x, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per-token values [BLOCK_T] -> per dot column [BLOCK_T * BLOCK_H] (column = t * BLOCK_H + h)."""
    return tl.reshape(tl.broadcast_to(x[:, None], (BLOCK_T, BLOCK_H)), (BLOCK_T * BLOCK_H,))


@triton.jit
def _dot(a, b, F32: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b with float32 accumulation; exact float32 products for float32 operands."""
    if F32:
        acc = tl.dot(a, b, input_precision="ieee")
    elif INTERPRETED:  # the CPU interpreter multiplies bfloat16's raw bits: upcast (exactly) first
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _row_scale(p, valid, sk_d, F32_LOAD: tl.constexpr):
    """The float32 scale stored (little-endian) at byte pointers ``p`` of fp8 rows."""
    if F32_LOAD:  # one aligned 4-byte load per key, which the pipeliner can prefetch
        scale = tl.load(p.to(tl.pointer_type(tl.float32), bitcast=True), mask=valid, other=0.0)
    else:
        bits = tl.zeros(p.shape, tl.int32)
        for i in tl.static_range(4):
            b = tl.load(p + i * sk_d, mask=valid, other=0)
            bits = bits | (b.to(tl.int32) << (8 * i))
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _into_fp16(qt, wt):
    """(q, head weights) -> (q * 2^e in fp16, weights * 2^-e), e putting max |q| in [2^14, 2^15):
    in fp16's range (65504) and exact, bf16's 8 significant bits fitting fp16's 11 down to 2^-17
    (values below about max |q| * 2^-31 lose low bits in fp16's subnormals, below about 2^-39
    flush to zero: nothing a float32 sum of 128 products keeps). relu(x * 2^e) * w * 2^-e =
    relu(x) * w, so the scores are unchanged."""
    q32 = qt.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q32), axis=1), axis=0)
    # floor(log2(amax)) from the exponent bits: exact (0 for amax = 0: no scaling)
    exp = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    e = tl.minimum(tl.maximum(tl.where(amax > 0, 14 - exp, 0), -126), 126)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e, exact
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    return (q32 * up).to(tl.float16), wt * down


@triton.jit
def _key_block(k_ptr, bt_ptr, r, j, j_end, n, d, D, S, page_size, sbt_b, sbt_p, sk_slot, sk_d,
               FP8: tl.constexpr, ALIGN: tl.constexpr, SCALE_F32: tl.constexpr, BLOCK_N: tl.constexpr,
               GUARD: tl.constexpr, PAGED_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr):
    """Key block j of request r, raw: (keys [BLOCK_N, BLOCK_D] as stored, fp8 row scales or a
    dummy, valid [BLOCK_N], positions s [BLOCK_N]). GUARD: nothing is read for j >= j_end (the
    prefetch past a split's last block); without it the caller keeps j < j_end. PAGED_BLOCKS:
    page_size is a multiple of BLOCK_N, so the block lies in one page, looked up once (page_size
    is a runtime value: a division and a remainder per key were half of the sm_90 loop's
    instructions). EVEN_D: D == BLOCK_D, no column mask."""
    s = j * BLOCK_N + n
    if PAGED_BLOCKS:
        # a tensor even where the interpreter's loop index is a Python int (a mask must be one)
        start = tl.cast(j, tl.int32) * BLOCK_N
        in_table = start < S  # S is a multiple of page_size: the whole block or none of it
        if GUARD:
            in_table = in_table & (j < j_end)
        page = tl.load(bt_ptr + r * sbt_b + (start // page_size) * sbt_p, mask=in_table, other=-1)
        valid = tl.broadcast_to(page, n.shape) >= 0  # [BLOCK_N], one value (the interpreter
        # turns a vector & a scalar of booleans into integers, which no mask may be)
        # the block's first row (one 64-bit product) + each key's 32-bit offset in it (hoisted)
        first = tl.multiple_of((page.to(tl.int64) * page_size + start % page_size) * sk_slot, ALIGN)
        rows = k_ptr + first + tl.multiple_of(n * sk_slot, ALIGN)
    else:
        in_table = s < S
        if GUARD:
            in_table = in_table & (s < j_end * BLOCK_N)
        page = tl.load(bt_ptr + r * sbt_b + (s // page_size) * sbt_p, mask=in_table, other=-1)
        valid = page >= 0
        rows = k_ptr + tl.multiple_of((page.to(tl.int64) * page_size + s % page_size) * sk_slot, ALIGN)
    if EVEN_D:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (d < D)[None, :]
    kt = tl.load(rows[:, None] + d[None, :] * sk_d, mask=mask, other=0)
    if FP8:
        scale = _row_scale(rows + D * sk_d, valid, sk_d, SCALE_F32)
    else:
        scale = tl.zeros([BLOCK_N], tl.float32)
    return kt, scale, valid, s


@triton.jit
def _score_block(kt, scale, valid, s, qt, wt, pos, active, out_ptr, t64, so_t, W,
                 FP8: tl.constexpr, FP16_DOTS: tl.constexpr, DOT_F32: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Scores of one key block for the round's tokens, stored: relu(k . q) weighted and summed
    over heads, times the fp8 row scale; -inf where the key is not visible to the token."""
    if FP8:
        if FP16_DOTS:  # exact: every e4m3 value is an fp16 value
            kt = kt.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            kt = from_fp8_bits(kt)
    acc = _dot(kt.to(qt.dtype), qt, DOT_F32, INTERPRETED)
    acc = tl.maximum(acc, 0.0) * wt[None, :]
    sc = tl.sum(tl.reshape(acc, (BLOCK_N, BLOCK_T, BLOCK_H)), axis=2)  # [BLOCK_N, BLOCK_T]
    if FP8:  # relu(scale * x) == scale * relu(x): the writer's scales are >= 1e-10
        sc = sc * scale[:, None]
    sc = tl.where(valid[:, None] & (s[:, None] <= pos[None, :]), sc, float("-inf"))
    tl.store(out_ptr + t64[None, :] * so_t + s[:, None], sc, mask=active[None, :] & (s < W)[:, None])


@triton.jit
def _logits_kernel(
    q_ptr, w_ptr, k_ptr, req_ptr, pos_ptr, bt_ptr, out_ptr,
    T, H, D, page_size, S, W, n_blocks, n_splits,
    sq_t, sq_h, sq_d, sw_t, sw_h, s_req, s_pos, sbt_b, sbt_p, sk_slot, sk_d, so_t,
    FP8: tl.constexpr, DOT_F32: tl.constexpr, INTERPRETED: tl.constexpr, ALIGN: tl.constexpr,
    SCALE_F32: tl.constexpr, FP16_DOTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, FILL: tl.constexpr, MIN_BLOCKS: tl.constexpr, PREFETCH: tl.constexpr,
    PAGED_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    in_t = t < T
    req = tl.load(req_ptr + t * s_req, mask=in_t, other=0)
    pos = tl.minimum(tl.load(pos_ptr + t * s_pos, mask=in_t, other=-1), S).to(tl.int32)

    col = tl.arange(0, BLOCK_T * BLOCK_H)
    col_t = tl.program_id(0) * BLOCK_T + col // BLOCK_H  # token of each dot column
    col_h = col % BLOCK_H
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    t64 = t.to(tl.int64)
    ct64 = col_t.to(tl.int64)

    done = ~in_t
    r = tl.min(tl.where(done, _INT_MAX, req))
    while r < _INT_MAX:  # one round per request among the group's tokens
        active = ~done & (req == r)
        done = done | active
        col_on = _flat(active, BLOCK_T, BLOCK_H) & (col_h < H)
        # q^T [D, BLOCK_T * BLOCK_H] and the head weights of the round's tokens (0 elsewhere).
        qt = tl.load(q_ptr + ct64[None, :] * sq_t + col_h[None, :] * sq_h + d[:, None] * sq_d,
                     mask=col_on[None, :] & (d < D)[:, None], other=0.0)
        wt = tl.load(w_ptr + ct64 * sw_t + col_h * sw_h, mask=col_on, other=0.0)
        if DOT_F32:
            qt = qt.to(tl.float32)
        elif FP16_DOTS:
            qt, wt = _into_fp16(qt, wt)
        # The key blocks up to the round's last visible key, shared evenly by the splits (at
        # least MIN_BLOCKS each): the work follows the context, not the block table's width.
        n_vis = tl.minimum(tl.max(tl.where(active, pos, -1)) // BLOCK_N + 1, n_blocks)
        per_split = tl.maximum(tl.cdiv(n_vis, n_splits), MIN_BLOCKS)
        j_begin = split * per_split
        j_end = tl.minimum(j_begin + per_split, n_vis)
        if PREFETCH:
            # Block j + 1's bytes are loaded into registers before block j is scored, so a
            # program always has one block in flight whatever the pipeliner would do (it gives
            # these register-consumed loads one or two copy buffers).
            kt, scale, valid, s = _key_block(k_ptr, bt_ptr, r, j_begin, j_end, n, d, D, S, page_size, sbt_b, sbt_p,
                                             sk_slot, sk_d, FP8, ALIGN, SCALE_F32, BLOCK_N, True, PAGED_BLOCKS, EVEN_D)
            for j in tl.range(j_begin, j_end, num_stages=1):  # no pipeliner: the prefetch is explicit
                kt_next, scale_next, valid_next, s_next = _key_block(
                    k_ptr, bt_ptr, r, j + 1, j_end, n, d, D, S, page_size, sbt_b, sbt_p, sk_slot, sk_d, FP8, ALIGN,
                    SCALE_F32, BLOCK_N, True, PAGED_BLOCKS, EVEN_D)
                _score_block(kt, scale, valid, s, qt, wt, pos, active, out_ptr, t64, so_t, W, FP8, FP16_DOTS,
                             DOT_F32, INTERPRETED, BLOCK_N, BLOCK_T, BLOCK_H)
                kt, scale, valid, s = kt_next, scale_next, valid_next, s_next
        else:
            for j in tl.range(j_begin, j_end, num_stages=NUM_STAGES):
                kt, scale, valid, s = _key_block(k_ptr, bt_ptr, r, j, j_end, n, d, D, S, page_size, sbt_b, sbt_p,
                                                 sk_slot, sk_d, FP8, ALIGN, SCALE_F32, BLOCK_N, False, PAGED_BLOCKS, EVEN_D)
                _score_block(kt, scale, valid, s, qt, wt, pos, active, out_ptr, t64, so_t, W, FP8, FP16_DOTS,
                             DOT_F32, INTERPRETED, BLOCK_N, BLOCK_T, BLOCK_H)
        if FILL:  # the blocks past every visible key, split the same way: -inf only
            per_split = tl.cdiv(n_blocks - n_vis, n_splits)
            j_begin = n_vis + split * per_split
            for j in range(j_begin, tl.minimum(j_begin + per_split, n_blocks)):
                s = j * BLOCK_N + n
                fill = tl.full((BLOCK_N, BLOCK_T), float("-inf"), tl.float32)
                tl.store(out_ptr + t64[None, :] * so_t + s[:, None], fill, mask=active[None, :] & (s < W)[:, None])
        r = tl.min(tl.where(done, _INT_MAX, req))


def _scores(q, weights, k_cache, req_ids, positions, block_table, layout, width, cfg, num_sms, fill=True):
    """Stage 1: float32 scores [T, width], -inf where not visible; without ``fill`` the
    columns past the last key block holding a visible key are left unwritten."""
    num_tokens, num_heads, head_dim = q.shape
    page_size = k_cache.shape[1]
    max_len = block_table.shape[1] * page_size
    if cfg.poison_scores:
        out = torch.full((num_tokens, width), float("nan"), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty((num_tokens, width), dtype=torch.float32, device=q.device)
    fp8 = layout == "fp8"
    cache = k_cache.view(torch.uint8) if fp8 else k_cache
    if fp8:
        dot_f32 = q.dtype == torch.float32
    else:  # a 16-bit dot only when q and the keys share that dtype; otherwise exact float32
        dot_f32 = q.dtype == torch.float32 or q.dtype != k_cache.dtype

    per_request = num_tokens // max(1, block_table.shape[0])
    # float32 (FMA) dots keep both operands in registers: one token per program there.
    block_t = cfg.block_t or (1 if per_request < 2 or dot_f32 else 2 if per_request < 4 else 4)
    block_h = _pow2_at_least(num_heads, 16)
    block_d = _pow2_at_least(head_dim, 16)
    block_n = cfg.block_n or (32 if dot_f32 else 64)
    n_blocks = triton.cdiv(width, block_n)
    groups = triton.cdiv(num_tokens, block_t)
    # ~16 programs per SM (a short last wave), each with >= MIN_BLOCKS key blocks (a split
    # reloads q); the kernel divides each token's visible blocks among the splits.
    min_blocks = cfg.min_blocks
    splits = cfg.splits or max(1, min(triton.cdiv(16 * num_sms, groups), triton.cdiv(n_blocks, min_blocks)))
    num_warps = cfg.num_warps or (4 if block_t == 1 and not dot_f32 else 8)
    # fp8 keys pass through registers (dequantized there), and the pipeliner double-buffers
    # them only from 5 stages on; bf16 keys go to the MMA straight from shared memory.
    num_stages = cfg.num_stages or (5 if fp8 else 3)
    # Row starts are multiples of ALIGN elements (Triton cannot see that 132-byte fp8 rows allow
    # 4-byte vector loads); the fp8 scale is read as one float32 where it is 4-byte aligned.
    row_stride = cache.stride(1)
    align = min(16, row_stride & -row_stride) if row_stride > 0 else 1
    scale_f32 = fp8 and all(v % 4 == 0 for v in (row_stride, head_dim * cache.stride(2), cache.data_ptr()))

    _logits_kernel[(groups, splits)](
        q, weights, cache, req_ids, positions, block_table, out,
        num_tokens, num_heads, head_dim, page_size, max_len, width, n_blocks, splits,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        req_ids.stride(0), positions.stride(0), block_table.stride(0), block_table.stride(1),
        row_stride, cache.stride(2), out.stride(0),
        FP8=fp8, DOT_F32=dot_f32, INTERPRETED=interpreted(_logits_kernel), ALIGN=align,
        SCALE_F32=scale_f32, FP16_DOTS=fp8 and cfg.fp16_dots and not dot_f32, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=block_d, BLOCK_N=block_n, NUM_STAGES=num_stages, FILL=fill, MIN_BLOCKS=min_blocks, PREFETCH=cfg.prefetch,
        PAGED_BLOCKS=page_size % block_n == 0, EVEN_D=head_dim == block_d,
        num_warps=num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# indexer_topk, stage 2: selection


@triton.jit
def _order_key(x):
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest but NaNs)."""
    return _order_bits(x.to(tl.uint32, bitcast=True))


@triton.jit
def _order_bits(bits):
    """A float32's bits (uint32) -> its order key: the sign flips the rest, or sets the top bit."""
    return bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000)


@triton.jit
def _row_keys(src, offs, W):
    """Order keys of columns ``offs`` of a row (``src``: the float32 scores' bits, as int32); 0
    (below every score) past its end: the bits of the negative NaN 0xFFFFFFFF, whose order key
    is 0, fill them, so no mask is applied after the load (LLVM would re-apply it on every pass
    of the bit search)."""
    return _order_bits(tl.load(src + offs, mask=offs < W, other=-1).to(tl.uint32, bitcast=True))


@triton.jit
def _bit_step(cnt, cand, K, thr, n_above, bit):
    """One bit of the K-th largest key, from the top: ``cnt`` keys are >= ``cand`` (= thr | bit).
    thr = the largest key with count(keys >= thr) >= K; the last failed candidate is thr + 1, so
    its count is count(keys > thr). Where exactly K keys are >= cand, those K are the winners:
    thr = cand - 1 with all K above it, and the search stops (bit 0) - most rows of distinct
    scores stop well before the 32nd bit."""
    n_above = tl.where(cnt >= K, n_above, cnt)
    thr = tl.where(cnt >= K, cand, thr)
    exact = cnt == K
    return (tl.where(exact, cand - 1, thr), tl.where(exact, K, n_above),
            tl.where(exact, tl.zeros_like(bit), bit >> 1))


@triton.jit
def _kth_in_tile(keys, K):
    """(thr, count above thr) of order keys [TILE] held in registers (padding: 0)."""
    thr = tl.zeros([], tl.uint32)
    n_above = tl.zeros([], tl.int32)
    bit = tl.full([], 0x80000000, tl.uint32)
    while bit != 0:
        cand = thr | bit
        thr, n_above, bit = _bit_step(tl.sum((keys >= cand).to(tl.int32)), cand, K, thr, n_above, bit)
    return thr, n_above


@triton.jit
def _kth_streamed(src, n_cols, K, CHUNK: tl.constexpr):
    """The same as _kth_in_tile, re-reading the row (from L1/L2) in chunks on every pass."""
    thr = tl.zeros([], tl.uint32)
    n_above = tl.zeros([], tl.int32)
    bit = tl.full([], 0x80000000, tl.uint32)
    while bit != 0:
        cand = thr | bit
        cnt = tl.zeros([], tl.int32)
        for c in range(0, n_cols, CHUNK):
            cnt += tl.sum((_row_keys(src, c + tl.arange(0, CHUNK), n_cols) >= cand).to(tl.int32))
        thr, n_above, bit = _bit_step(cnt, cand, K, thr, n_above, bit)
    return thr, n_above


@triton.jit
def _winners_to(dst, k, offs, n_cols, thr, n_above, need, seen_above, seen_equal):
    """Keys k of columns offs that win, packed (signed key << 32 | column) into the scratch row:
    the ones above thr at ranks seen_above.., then the first ``need`` equal ones after all
    n_above. One scan: the two running counts share an int32 (above in the low 16 bits, equal
    in the high 16; a chunk has at most 32K columns, see _select_triton). Returns the counts
    with this chunk's added."""
    above = k > thr
    equal = (k == thr) & (offs < n_cols)
    both = tl.cumsum(above.to(tl.int32) + (equal.to(tl.int32) << 16), 0).to(tl.uint32, bitcast=True)
    rank_above = seen_above + (both & 0xFFFF).to(tl.int32) - 1
    rank_equal = seen_equal + (both >> 16).to(tl.int32) - 1
    signed = (k ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    packed = (signed << 32) | offs.to(tl.int64)
    slot = tl.where(above, rank_above, n_above + rank_equal)
    tl.store(dst + slot, packed, mask=above | (equal & (rank_equal < need)))
    total = tl.max(both)  # the inclusive scan's last value: both counts in one reduction
    return seen_above + (total & 0xFFFF).to(tl.int32), seen_equal + (total >> 16).to(tl.int32)


@triton.jit
def _select_kernel(
    s_ptr, pos_ptr, out_ptr, tmp_ptr, S, K, ss_t, s_pos, so_t, st_t,
    TILE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * ss_t
    dst = tmp_ptr + row * st_t
    # Only columns 0..positions[row] (and < S) can hold a visible key; the rest is not read.
    n_cols = tl.minimum(tl.maximum(tl.load(pos_ptr + row * s_pos) + 1, 0), S).to(tl.int32)
    zero = tl.zeros([], tl.int32)
    # The K-th largest key (thr) and how many are above it; the winners are those above and
    # the first `need` equal to it (none where the search stopped at exactly K above),
    # compacted into the scratch row.
    if n_cols <= TILE and n_cols > TILE // 4:  # the row in registers (a short one would waste the tile)
        thr, n_above = _kth_in_tile(_row_keys(src, tl.arange(0, TILE), n_cols), K)
    else:
        thr, n_above = _kth_streamed(src, n_cols, K, CHUNK)
    need = K - n_above
    # compacted a chunk at a time, re-read from L1/L2 (a whole tile's scan in registers spills)
    seen_above, seen_equal = zero, zero
    for c in range(0, n_cols, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        seen_above, seen_equal = _winners_to(dst, _row_keys(src, offs, n_cols), offs, n_cols, thr, n_above, need,
                                             seen_above, seen_equal)
    tl.debug_barrier()  # the scratch row is re-read by other threads of this program

    i = tl.arange(0, BLOCK_K)
    written = n_above + tl.minimum(seen_equal, need)  # < K for a row shorter than K
    picked = tl.sort(tl.load(dst + i, mask=i < written, other=-9223372036854775808), descending=True)
    neg_inf = (_order_key(tl.full([], float("-inf"), tl.float32)) ^ 0x80000000).to(tl.int32, bitcast=True)
    res = tl.where((picked >> 32) > neg_inf.to(tl.int64), picked.to(tl.int32), -1)
    tl.store(out_ptr + row * so_t + i, res, mask=i < K)


def _select_triton(scores, positions, max_len, topk, out, cfg):
    """out[t] <- the topk best of scores[t, :min(positions[t] + 1, max_len)], -1 padded."""
    rows = scores.shape[0]
    tile = min(triton.next_power_of_2(max(1, max_len)), cfg.max_tile)
    # <= 32K columns a chunk: _winners_to's running counts are 16-bit fields of one int32
    chunk = min(tile, cfg.select_chunk, 32768)
    block_k = _pow2_at_least(topk, 16)
    num_warps = 16 if tile >= 16384 else 8 if tile >= 4096 else 4
    scratch = torch.empty((rows, block_k), dtype=torch.int64, device=scores.device)
    _select_kernel[(rows,)](
        scores.view(torch.int32), positions, out, scratch, max_len, topk,
        scores.stride(0), positions.stride(0), out.stride(0), scratch.stride(0),
        TILE=tile, CHUNK=chunk, BLOCK_K=block_k, num_warps=num_warps,
    )


def _select_torch(scores, topk, out):
    best, idx = scores.topk(topk, dim=1)
    out.copy_(torch.where(best > float("-inf"), idx, torch.full_like(idx, -1)))


def indexer_topk(q, weights, k_cache, req_ids, positions, block_table, layout, topk,
                 config: IndexerConfig | None = None) -> torch.Tensor:
    check_runnable("indexer_topk", _logits_kernel, q)
    cfg = config or IndexerConfig()
    if cfg.topk_impl not in ("triton", "torch"):
        raise ValueError(f"IndexerConfig.topk_impl: expected 'triton' or 'torch', got {cfg.topk_impl!r}")
    num_tokens = q.shape[0]
    out = torch.empty((num_tokens, topk), dtype=torch.int32, device=q.device)
    max_len = block_table.shape[1] * k_cache.shape[1]
    width = max(max_len, topk)
    chunk = max(1, cfg.max_scores // width)  # bounds the scores buffer for long prefills
    num_sms = hardware(q.device).num_sms
    use_torch = cfg.topk_impl == "torch" or triton.next_power_of_2(topk) > cfg.max_sort
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        # torch.topk reads whole rows, so they are filled with -inf to the end; the Triton
        # selection reads only up to each token's position, and nothing past it is written.
        scores = _scores(q[t0:t1], weights[t0:t1], k_cache, req_ids[t0:t1], positions[t0:t1],
                         block_table, layout, width, cfg, num_sms, fill=use_torch)
        if use_torch:
            _select_torch(scores, topk, out[t0:t1])
        else:
            _select_triton(scores, positions[t0:t1], max_len, topk, out[t0:t1], cfg)
    return out


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4's CSA indexer: the same two stages over the compressed index keys


def csa_indexer_topk(q, weights, index_cache, positions, req_ids, block_table, page_size, compress_rate, topk,
                     softmax_scale, *, config: IndexerConfig | None = None) -> torch.Tensor:
    """``mlagraph::csa_indexer_topk`` (arguments checked by its check) as :func:`indexer_topk`.

    The index cache ``[num_pages, E, Di]`` is a paged key cache whose "positions" are entries:
    entry e lives on block-table column ``e // E``, row ``e % E`` when pages hold E = page_size / m
    entries, and on column ``e · m / page_size`` (one entry a page) when m exceeds the page, which
    a strided view of the block table turns into column e. A token at position p sees the
    entries closed by p, e <= (p + 1) // m - 1: that is the position the selection is given.
    The softmax scale is positive, so it folds into the head weights (relu(x)·s·w = relu(x)·(s·w)).
    """
    table = block_table[:, :: compress_rate // page_size] if compress_rate > page_size else block_table
    last = torch.div(positions.long() + 1, compress_rate, rounding_mode="floor") - 1
    return indexer_topk(q, weights * softmax_scale, index_cache, req_ids, last, table, "bf16", topk, config)
