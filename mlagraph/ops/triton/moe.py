"""Triton ``moe``: decode-sized batches in three launches with no sort, mid-sized ones through
our grouped GEMM, large ones through the generic op.

The generic op (:mod:`mlagraph.ops.moe`) sorts the T*top_k (token, slot) rows by expert and
runs two grouped GEMMs; between routing and the result that is about twenty small kernels
(argsort, histogram, cumsum, gathers, the GEMMs, activation, scatter back, weighted sum). At
decode, where T*top_k is a few dozen rows, those launches cost more than reading the experts'
weights (a V2-Lite layer at batch 1 reads 6 experts, 104 MB, in about 25 us). Here, for batches
of at most :data:`PAIRS_PER_EXPERT_MAX` pairs per expert:

1. ``_gate_up_kernel``, grid (pairs, cdiv(I, BLOCK_N)): pair p = (token t, slot j) with expert
   e = ids[t, j]; gate and up rows [BLOCK_N] of W_e times hidden[t], float32 sums, each rounded
   to hidden's dtype (as the grouped GEMM's output is), then silu(gate) * up in float32,
   stored in hidden's dtype: act [pairs, I].
2. ``_down_kernel``, grid (pairs, cdiv(D, BLOCK_N)): y[p] = down_e @ act[p], rounded to
   hidden's dtype, stored as float32 [pairs, D].
3. the sorted paths' combine (:func:`.moe_glue.combine_rows`, y's rows in pair order): out[t] =
   sum_j weight[t, j] * y[t*k + j] in float32 (slot order), stored in hidden's dtype: no
   atomics, the same sum every run.

Each program is a GEMV over one pair's expert: its tile of weight rows is read once, as stored
(fp8 experts as e4m3 bytes, times their 128x128 block scales, rounded to hidden's dtype: the
numbers the reference's dequantization makes). Pairs vary fastest in the grid, so pairs that
share an expert read the same weight rows at about the same time and the second read is an L2
hit; an expert no pair picked is never read. Expert parallel (``first_expert``): a pair whose
expert lives on another rank computes nothing and weighs 0.

Bigger batches sort the rows by expert (tensor-core GEMMs): up to
:data:`TRITON_GROUPED_PER_EXPERT_MAX` rows an expert in five launches of ours
(:func:`grouped_triton`: the sort and tile schedule in one, :mod:`.moe_sort`; our grouped GEMM,
:mod:`.grouped_fp8`, reading each row's token in place), past it (prefill) with the generic
op's GEMMs behind the same sort, blocked (:func:`sorted_generic`). :func:`path_for` decides, from shapes only. Both sorted paths take the
fused glue of :mod:`.moe_glue` (silu * up between the GEMMs, unsort + weighted sum after them).
Routing, on every path, is one launch (:func:`.route.route`: the generic op's choice of experts
up to ties, in place of its five to twelve torch kernels; V3's grouped router took 43.7 us a layer
at T=1 that way on the H200, the kernel 5.2). Nothing reads a value on the host: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import moe as _generic
from ._fp8 import from_fp8_bits
from ._hardware import interpreted
from ._launch import check_runnable
from .grouped_fp8 import config_for as grouped_config
from .grouped_fp8 import half_experts
from .grouped_fp8 import run_tiles
from .moe_glue import combine_rows, silu_mul, silu_mul_apart, unsort_combine
from .moe_sort import ONE_PROGRAM_MAX_PAIRS, sort_pairs
from .route import route

# Where each path pays, in (token, expert) pairs per expert of the layer (T * top_k / E).
# 2026-12-04, H200 (benchmarks/kernels.py --only moe; CUDA-graph replays): fp8 experts, the pair
# kernels beat the grouped fp8 kernel at 1/8 a expert (V3 T=4: 535 vs 558 us) and lose at 1/4
# (T=8: 972 vs 874). 2026-12-06, H100 (the sorted path with its one-launch sort, bf16): the pair
# kernels win at 0.09 a expert (V2-Lite T=1: 47 vs 68 us), tie at 0.5 (V3 T=16: 2798 vs 2794) and
# lose at 1 (V3 T=32: 4577 vs 4296) and 1.5 (V2-Lite T=16: 342 vs 315); the sorted path beats the
# generic path (torch sort, F.grouped_mm, our fused glue) up to the 24 a expert measured (V2-Lite
# T=256: 478 vs 491 us) and the torch sort feeding the same GEMM by about 100 us a V2-Lite layer.
PAIRS_PER_EXPERT_MAX = {"bf16": 0.75, "fp8": 0.125}
# Our sorted path up to here (bf16 and fp8 experts), the generic op's past it: F.grouped_mm for bf16,
# the same grouped fp8 kernel behind a torch sort for fp8 (W8A8 from 64 rows an expert).
TRITON_GROUPED_PER_EXPERT_MAX = 32.0
SCALE_BLOCK = 128  # fp8 experts: one float32 scale per 128 x 128 weight block


@triton.jit
def _expert_of(ids_ptr, p, first_expert, num_local):
    """Pair p's local expert id, and whether this rank holds it."""
    e = tl.load(ids_ptr + p).to(tl.int32) - first_expert
    return e, (e >= 0) & (e < num_local)


@triton.jit
def _tile_dot(w_rows, s_rows, vec, k0, K, row_ok, FP8: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr,
              OUT_DTYPE: tl.constexpr):
    """sum over k in [k0, k0 + KB*KC) of W[row, k] * vec[k] -> [BLOCK_N] float32, with W as
    stored in OUT_DTYPE: fp8 rows are e4m3 bytes times their 128x128 block's scale, rounded to
    OUT_DTYPE as the reference dequantizes. ``w_rows`` / ``s_rows``: [BLOCK_N, 1, 1] pointers to
    each row's weights and scales. The tile is [BLOCK_N, KB, KC]: KB runs of KC columns, KC at
    most one scale block wide, so a run has one scale a row ([BLOCK_N, KB, 1]) and an fp8 tile
    can span several blocks (wide loads) without a gather of its scales."""
    ks = k0 + tl.arange(0, KB)[None, :, None] * KC + tl.arange(0, KC)[None, None, :]  # [1, KB, KC]
    k_ok = ks < K
    x = tl.load(vec + ks, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(w_rows + ks, mask=row_ok & k_ok, other=0)
    if FP8:
        scale = tl.load(s_rows + (k0 + tl.arange(0, KB)[None, :, None] * KC) // 128, mask=row_ok, other=0.0)
        w = (from_fp8_bits(w) * scale).to(OUT_DTYPE)
    return tl.sum(tl.sum(w.to(tl.float32) * x, 2), 1)


@triton.jit
def _silu_up(gate_w, up_w, gate_s, up_s, x_row, D, row_ok, FP8: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr,
             OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """silu(gate) * up for BLOCK_N rows of one expert's gate and up weights times one token ->
    [BLOCK_N] float32; gate and up each rounded to OUT_DTYPE first, as a GEMM's output is."""
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, D, KB * KC):
        gate += _tile_dot(gate_w, gate_s, x_row, k0, D, row_ok, FP8, KB, KC, OUT_DTYPE)
        up += _tile_dot(up_w, up_s, x_row, k0, D, row_ok, FP8, KB, KC, OUT_DTYPE)
    gate = gate.to(OUT_DTYPE).to(tl.float32)
    up = up.to(OUT_DTYPE).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _routed_gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, p, cols, col_ok, D, I, first_expert, num_local,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at,
                    TOP_K: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                    KC: tl.constexpr):
    """Pair p = (token p // TOP_K, its expert ids[p]): act[p, cols] (nothing for another rank's expert)."""
    e, here = _expert_of(ids_ptr, p, first_expert, num_local)
    if here:
        t = p // TOP_K
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        rows = cols[:, None, None]
        act = _silu_up(w_base + rows.to(tl.int64) * stride_wn, w_base + (I + rows).to(tl.int64) * stride_wn,
                       s_base + (rows // 128) * stride_sn, s_base + ((I + rows) // 128) * stride_sn,
                       x_ptr + t.to(tl.int64) * stride_xt, D, col_ok[:, None, None], FP8, KB, KC,
                       x_ptr.dtype.element_ty, BLOCK_N)
        tl.store(act_ptr + p.to(tl.int64) * stride_at + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, D, I, first_expert, num_local,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at,
    sg_ptr, su_ptr, sgs_ptr, sus_ptr, I_S, num_pairs, stride_sg, stride_su, stride_sgs, stride_sus,
    TOP_K: tl.constexpr, FP8: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
    KC: tl.constexpr,
):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    if p >= num_pairs:
        # Shared experts (none: num_pairs is the grid's size): program row q = t * CHUNKS + c
        # computes the shared MLP's intermediate columns c*I .. c*I + I - 1 (of I_S) for token t.
        q = p - num_pairs
        t = q // CHUNKS
        r = (q % CHUNKS) * I + cols
        rows = r[:, None, None]
        act = _silu_up(sg_ptr + rows.to(tl.int64) * stride_sg, su_ptr + rows.to(tl.int64) * stride_su,
                       sgs_ptr + (rows // 128) * stride_sgs, sus_ptr + (rows // 128) * stride_sus,
                       x_ptr + t.to(tl.int64) * stride_xt, D, (col_ok & (r < I_S))[:, None, None], FP8, KB, KC,
                       x_ptr.dtype.element_ty, BLOCK_N)
        tl.store(act_ptr + p.to(tl.int64) * stride_at + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)
    else:
        _routed_gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, p, cols, col_ok, D, I, first_expert, num_local,
                        stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at, TOP_K, FP8, BLOCK_N, KB, KC)


@triton.jit
def _routed_down(act_ptr, ids_ptr, w_ptr, s_ptr, y_ptr, p, cols, col_ok, D, I, first_expert, num_local,
                 stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                 FP8: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr):
    """y[p, cols] = down_e @ act[p], rounded to act's dtype as the grouped GEMM's output is."""
    e, here = _expert_of(ids_ptr, p, first_expert, num_local)
    if here:
        a_row = act_ptr + p.to(tl.int64) * stride_at
        rows = cols[:, None, None]
        w_rows = w_ptr + e.to(tl.int64) * stride_we + rows.to(tl.int64) * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + (rows // 128) * stride_sn
        out_dtype = act_ptr.dtype.element_ty
        y = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, I, KB * KC):
            y += _tile_dot(w_rows, s_rows, a_row, k0, I, col_ok[:, None, None], FP8, KB, KC, out_dtype)
        y = y.to(out_dtype).to(tl.float32)
        tl.store(y_ptr + p.to(tl.int64) * stride_yt + cols, y, mask=col_ok)


@triton.jit
def _down_kernel(
    act_ptr, ids_ptr, w_ptr, s_ptr, y_ptr, D, I, first_expert, num_local,
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    sd_ptr, sds_ptr, I_S, num_pairs, stride_sd, stride_sds,
    FP8: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, KC: tl.constexpr,
):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    if p >= num_pairs:
        # Shared chunk c (none: num_pairs is the grid's size): down's columns c*I .. c*I + I - 1,
        # whose intermediate values are this program row's act. Left in float32: the combine
        # sums a token's chunks and rounds once, as the shared MLP's one down GEMM does.
        c0 = ((p - num_pairs) % CHUNKS) * I
        rows = cols[:, None, None]
        w_rows = sd_ptr + rows.to(tl.int64) * stride_sd + c0
        s_rows = sds_ptr + (rows // 128) * stride_sds + c0 // 128  # fp8: the launcher keeps I whole blocks
        a_row = act_ptr + p.to(tl.int64) * stride_at
        y = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, I, KB * KC):
            y += _tile_dot(w_rows, s_rows, a_row, k0, tl.minimum(I, I_S - c0), col_ok[:, None, None], FP8, KB, KC,
                           act_ptr.dtype.element_ty)
        tl.store(y_ptr + p.to(tl.int64) * stride_yt + cols, y, mask=col_ok)
    else:
        _routed_down(act_ptr, ids_ptr, w_ptr, s_ptr, y_ptr, p, cols, col_ok, D, I, first_expert, num_local,
                     stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt, FP8, BLOCK_N, KB, KC)


def default_config(pairs: int, fp8: bool) -> dict:
    """Tiles from shapes only (no autotuning: nothing is timed at a call or during capture), from
    the H200 sweeps (benchmarks/kernels.py --only moe --sweep, 2026-12-04; CUDA-graph replays).
    BLOCK_N weight rows x BLOCK_K columns a step, per program.
    - bf16, up to 8 pairs: 16 x 512 in 4 warps (V2-Lite T=1: 47 us; 32 x 256: 59).
    - bf16, more pairs: 8 x 512 in 2 warps, more and smaller programs (V2-Lite T=2 / 4 / 8 / 16:
      66 / 115 / 176 / 301 us against 72 / 127 / 198 / 327 for 16 x 512 in 4 warps).
    - fp8: 16 x 128 (one scale block wide) in 4 warps (V3 T=1 / 4: 200 / 535 us; 64 x 128 in
      8 warps: 221 / 537; in 4 warps: 334 / 746). Tiles spanning several scale blocks do not
      pay (2026-12-04, second sweep: 16 x 512 in 4 warps 190 / 559 us against 188 / 512;
      8 x 1024 in 4 warps 190 / 561): the fp8 GEMV is bound by its conversions, not its loads."""
    if fp8:
        return {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}
    if pairs <= 8:
        return {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}
    return {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2}


def path_for(num_tokens: int, top_k: int, num_experts: int, fp8: bool) -> str:
    """Which implementation takes a call: ``"pairs"`` (the kernels above), ``"triton_grouped"``
    (:func:`grouped_triton`) or ``"generic"`` (:func:`sorted_generic`: F.grouped_mm, or the
    grouped fp8 kernel, behind our sort). ``num_experts``: the router's E."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= PAIRS_PER_EXPERT_MAX["fp8" if fp8 else "bf16"] or num_tokens * top_k <= 1:
        return "pairs"
    if per_expert <= TRITON_GROUPED_PER_EXPERT_MAX and num_tokens * top_k <= ONE_PROGRAM_MAX_PAIRS:
        return "triton_grouped"
    return "generic"


def grouped_triton(hidden, weights, ids, gate_up_proj, down_proj, first_expert=None, gate_up_scale=None,
                   down_scale=None, config: dict | None = None, shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """The sorted path in five launches after routing: the pairs sorted by expert and the tile
    schedule in one (:func:`.moe_sort.sort_pairs`), our grouped GEMM reading each sorted row's
    token from ``hidden`` directly (no sorted copy), silu * up, the down GEMM, and the unsort +
    weighted sum (:mod:`.moe_glue`). bf16 or fp8 experts (W8A16: each expert's e4m3 weights read
    once). ``config``: the GEMMs' tile overrides (BLOCK_M, BLOCK_N, num_warps, num_stages).
    ``shared_out``: the shared experts' [T, D] output, added by the combine, or None."""
    num_tokens, top_k = ids.shape
    num_local, two_inter = gate_up_proj.shape[:2]
    pairs = num_tokens * top_k
    # one schedule (BLOCK_M rows a tile) for both GEMMs; BLOCK_N from each GEMM's own width
    up_cfg = grouped_config(pairs, num_local, two_inter, hidden.device, config,
                            half_experts=half_experts(gate_up_proj, gate_up_scale))
    down_cfg = grouped_config(pairs, num_local, down_proj.shape[1], hidden.device, config,
                              half_experts=half_experts(down_proj, down_scale))
    sort = sort_pairs(ids, num_local, up_cfg["BLOCK_M"], first_expert)
    gate_up = run_tiles(hidden, gate_up_proj, gate_up_scale, sort.schedule, pairs, up_cfg, order=sort.order,
                        top_k=top_k)
    act = silu_mul(gate_up, hidden.dtype)
    y = run_tiles(act, down_proj, down_scale, sort.schedule, pairs, down_cfg)
    return combine_rows(y, sort.row_of, weights, sort.remote if first_expert is not None else None, hidden.dtype,
                        shared=shared_out)


def sorted_generic(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, num_routed,
                   first_expert=None, shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """The generic op's grouped path (``F.grouped_mm`` for bf16 experts, the grouped fp8 kernel
    for fp8 ones) behind our sort in place of torch's: :func:`.moe_sort.sort_pairs` gives the
    rows' order, the group ends the GEMMs take, and each pair's row for the combine, in one to
    three launches where torch's sort takes about ten (a stable radix argsort whose host side
    alone took about 100 us a layer in a profiled 1K-token V2-Lite prefill on the H200, a
    histogram, a cumsum, the inverse permutation). Same rows, same order, same GEMMs: the
    generic path's result. Where the generic op has no grouped GEMM (CUDA float32) it runs as is.
    ``shared_out``: the shared experts' [T, D] output, added as the combine's last step, or None."""
    gemms = _generic._grouped_gemms(hidden, gate_up_proj, down_proj, gate_up_scale, down_scale)
    if gemms is None:
        out = _generic.routed_grouped(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale,
                                      num_routed, first_expert, activate=silu_mul, combine=unsort_combine)
        return out if shared_out is None else out + shared_out
    gate_up_mm, down_mm = gemms
    top_k = ids.shape[1]
    sort = sort_pairs(ids, gate_up_proj.shape[0], None, first_expert)  # these GEMMs take group ends, no tiles
    x = hidden.index_select(0, sort.order // top_k)  # [T*k, D], sorted rows
    y = down_mm(silu_mul(gate_up_mm(x, sort.group_end), hidden.dtype), sort.group_end)
    return combine_rows(y, sort.row_of, weights, sort.remote if first_expert is not None else None, hidden.dtype,
                        shared=shared_out)


def shared_folds(shared: tuple | None, inter: int, fp8: bool) -> bool:
    """Whether the pair kernels can run these shared experts (gate, up, down, and their scales
    or Nones) as extra program rows: stored as the routed experts are (both fp8 or neither),
    rows contiguous, and, for fp8 cut into chunks of the routed width, chunks of whole 128-column
    scale blocks."""
    if shared is None:
        return False
    gate, up, down, gate_scale = shared[:4]
    if (gate_scale is not None) != fp8 or any(w.stride(1) != 1 for w in (gate, up, down)):
        return False
    return not fp8 or inter % SCALE_BLOCK == 0 or gate.shape[0] <= inter


def routed_experts(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, first_expert,
                   config: dict | None = None, shared: tuple | None = None,
                   shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, D], weights [T, k] float32, ids [T, k] int64 (global expert ids) -> [T, D]:
    the routed experts' weighted sum, by the three kernels above. ``shared``: None, or the
    shared experts (gate [I_s, D], up, down [D, I_s], gate / up / down scales or None), run as
    ceil(I_s / I) extra program rows a token in both GEMV kernels (:func:`shared_folds` must
    hold) and added by the combine: the ``moe`` op's result with shared experts. ``shared_out``:
    or their output [T, D], computed elsewhere, for the combine to add."""
    check_runnable("moe", _gate_up_kernel, hidden)
    num_tokens, dim = hidden.shape
    top_k = ids.shape[1]
    num_local, two_inter = gate_up_proj.shape[:2]
    inter = two_inter // 2
    fp8 = gate_up_scale is not None
    cfg = default_config(num_tokens * top_k, fp8)
    if interpreted(_gate_up_kernel):
        cfg.update(BLOCK_N=16, BLOCK_K=32)  # tiny CPU shapes: small tiles, few wasted lanes
    cfg.update(config or {})
    block_n, block_k, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    stages = cfg.get("num_stages")  # None: Triton's default software pipelining
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"mlagraph_triton.moe config: BLOCK_K must be a power of 2, got {block_k}")
    # fp8: runs of at most one scale block (KC columns) side by side; float: one run
    kc = min(block_k, SCALE_BLOCK) if fp8 else block_k
    kb = block_k // kc
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    flat_ids = ids.reshape(-1).contiguous()
    w1 = gate_up_proj.view(torch.uint8) if fp8 else gate_up_proj
    w2 = down_proj.view(torch.uint8) if fp8 else down_proj
    s1 = gate_up_scale if fp8 else w1.new_empty((1, 1, 1), dtype=torch.float32)
    s2 = down_scale if fp8 else w1.new_empty((1, 1, 1), dtype=torch.float32)
    first = 0 if first_expert is None else int(first_expert)
    if shared is None:  # no shared rows: the kernels' shared branch never runs (p < pairs)
        chunks, inter_s, (sg, su, sd, sgs, sus, sds) = 1, 0, (w1, w1, w2, s1, s1, s2)
    else:
        if not shared_folds(shared, inter, fp8):
            raise ValueError("mlagraph_triton.moe: these shared experts cannot run in the pair kernels "
                             "(shared_folds is False)")
        sg, su, sd, sgs, sus, sds = shared
        inter_s = sg.shape[0]
        chunks = triton.cdiv(inter_s, inter)
        if fp8:
            sg, su, sd = sg.view(torch.uint8), su.view(torch.uint8), sd.view(torch.uint8)
        else:
            sgs = sus = sds = s1
    rows = pairs + (0 if shared is None else num_tokens * chunks)  # program rows: pairs, then shared chunks
    act = torch.empty(rows, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(rows, dim, dtype=torch.float32, device=hidden.device)
    _gate_up_kernel[(rows, triton.cdiv(inter, block_n))](
        x, flat_ids, w1, s1, act, dim, inter, first, num_local,
        x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), act.stride(0),
        sg, su, sgs, sus, inter_s, pairs, sg.stride(0), su.stride(0), sgs.stride(0), sus.stride(0),
        TOP_K=top_k, FP8=fp8, CHUNKS=chunks, BLOCK_N=block_n, KB=kb, KC=kc, num_warps=warps,
        **({} if stages is None else {"num_stages": stages}),
    )
    _down_kernel[(rows, triton.cdiv(dim, block_n))](
        act, flat_ids, w2, s2, y, dim, inter, first, num_local,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        sd, sds, inter_s, pairs, sd.stride(0), sds.stride(0),
        FP8=fp8, CHUNKS=chunks, BLOCK_N=block_n, KB=kb, KC=kc, num_warps=warps,
        **({} if stages is None else {"num_stages": stages}),
    )
    # y's rows are the pairs in order, then each token's shared chunks; with expert shards the
    # ids tell this rank's pairs
    return combine_rows(y[:pairs], None, weights, None, hidden.dtype,
                        flat_ids if first_expert is not None else None, first, num_local,
                        shared_out if shared is None else y[pairs:])


def moe(hidden, router_logits, gate_up_proj, down_proj, e_score_correction_bias, top_k, scoring_func,
        topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor, gate_up_scale=None,
        down_scale=None, first_expert=None, *shared):
    """The triton backend's ``moe`` (arguments already checked by the generic op's check): the
    pair kernels for decode-sized batches, our sorted path for mid-sized ones, the generic
    grouped path for prefill (:func:`path_for`). Shared experts (``*shared``: the op's six
    shared-expert arguments) run inside the pair kernels where :func:`shared_folds` says they
    can; elsewhere as the generic op runs them (three GEMMs, our silu * up), their sum added by
    the routed path's combine."""
    weights, ids = route(router_logits, e_score_correction_bias, top_k, scoring_func, topk_method, n_group,
                         topk_group, norm_topk_prob, routed_scaling_factor)
    shared = tuple(shared) + (None,) * (6 - len(shared))
    shared = None if shared[0] is None else shared
    fp8 = gate_up_scale is not None
    path = path_for(hidden.shape[0], top_k, router_logits.shape[1], fp8)
    if path == "pairs" and (shared is None or shared_folds(shared, gate_up_proj.shape[1] // 2, fp8)):
        return routed_experts(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, first_expert,
                              shared=shared)
    shared_out = None if shared is None else _generic.shared_experts(hidden, *shared, activate=silu_mul_apart)
    if path == "pairs":
        return routed_experts(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, first_expert,
                              shared_out=shared_out)
    if path == "triton_grouped":
        return grouped_triton(hidden, weights, ids, gate_up_proj, down_proj, first_expert, gate_up_scale, down_scale,
                              shared_out=shared_out)
    return sorted_generic(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale,
                          router_logits.shape[1], first_expert, shared_out=shared_out)
