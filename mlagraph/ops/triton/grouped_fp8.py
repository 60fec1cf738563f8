"""A grouped GEMM over fp8 block-scaled expert weights: what ``mlagraph::moe`` runs on CUDA
for fp8 experts, so each routed expert's e4m3 weights are read once, as e4m3.
:func:`grouped_float_mm` runs the same schedule over float experts (a peer of ``F.grouped_mm``
for decode-sized groups).

    out[r, n] = sum_k x[r, k] * W[e(r), n, k] * scale[e(r), n // 128, k // 128]

x [R, K] holds the rows sorted by expert; ``offs`` [E] int32 are the group ends (as for
``F.grouped_mm``). W [E, N, K] e4m3, scale [E, ceil(N/128), ceil(K/128)] float32.

Schedule (no host sync, no data-dependent shape): M tiles of BLOCK_M rows never straddle two
experts, so an expert with c rows takes ceil(c / BLOCK_M) tiles and all of them together at most
cdiv(R, BLOCK_M) + min(E, R): the grid's fixed M extent. :func:`tile_schedule` assigns tiles to
(expert, first row, row end) with torch ops on the device; the tiles past the last real one see
expert E and exit. Experts with no rows get no tile, so their weights are never read.

Per tile, along K in steps of 128 (one scale block): load x [BLOCK_M, 128] and the expert's
W [BLOCK_N, 128] bytes, dequantize W in registers (e4m3 -> float32, times the block scale of
each column's 128-row block, rounded to x's dtype: the same numbers the reference's per-call
dequantization makes), and accumulate ``x @ W.T`` in float32. Activations stay in x's dtype
(W8A16): decode is bound by reading the weights, which this reads at 1 byte each. For large
groups (prefill, :func:`fp8_activations_pay`) x is first quantized per 1x128 group and each
block is one e4m3 x e4m3 tensor-core product scaled by both block scales (W8A8, DeepSeek's
own recipe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import quantize_1x128
from ._fp8 import from_fp8_bits
from ._hardware import hardware, interpreted
from ._launch import check_runnable
from ._tl import dot as _dot

BLOCK_K = 128  # one fp8 scale block along K (float experts may take other K steps: config "BLOCK_K")


@triton.jit
def _k_step(acc, k0, x_ptr, xs_ptr, s_base, w_base, x_rows, cols, row_ok, col_ok, K, stride_xm, stride_xs, stride_wn,
            BLOCK_K: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
            W_FP8: tl.constexpr):
    """acc += x[rows, k0:k0+BLOCK_K] @ W[e, cols, k0:k0+BLOCK_K].T, W dequantized or not (see the
    module docstring); masked rows and columns read nothing."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x_mask, w_mask = row_ok[:, None] & k_ok[None, :], col_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=x_mask, other=0)
    w8 = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0)  # e4m3 bits, or floats
    if not W_FP8:  # float experts (x's dtype): the same schedule, no scales
        acc = _dot(x, tl.trans(w8), acc, PRECISION, UPCAST)
    elif A_FP8:  # e4m3 x e4m3 on the tensor cores, both scales applied to the block's product
        x_scale = tl.load(xs_ptr + x_rows * stride_xs + k0 // 128, mask=row_ok, other=0.0)  # [BLOCK_M]
        scale = tl.load(s_base + k0 // 128, mask=col_ok, other=0.0)  # [BLOCK_N]: one per column's block row
        if UPCAST:  # the interpreter: exact float32 products of the e4m3 values
            part = tl.dot(from_fp8_bits(x), tl.trans(from_fp8_bits(w8)), input_precision="ieee")
        else:
            part = tl.dot(x.to(tl.float8e4nv, bitcast=True), tl.trans(w8.to(tl.float8e4nv, bitcast=True)))
        acc += part * x_scale[:, None] * scale[None, :]
    else:  # weights dequantized in registers, x as it is
        scale = tl.load(s_base + k0 // 128, mask=col_ok, other=0.0)
        w = (from_fp8_bits(w8) * scale[:, None]).to(x.dtype)
        acc = _dot(x, tl.trans(w), acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _tile(e, pid_m, pid_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, N, K,
          stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_om,
          NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          A_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, W_FP8: tl.constexpr,
          GATHER_K: tl.constexpr, GUARD: tl.constexpr):
    """One output tile: M tile pid_m (expert e's rows) x N tile pid_n, the K loop, the store.
    GUARD: e may be NUM_EXPERTS (no expert) and the caller did not branch on it: rows and
    columns are masked instead, and the weight pointers stay inside the tensor."""
    row0 = tl.load(tile_row0_ptr + pid_m)
    row_end = tl.load(tile_row_end_ptr + pid_m)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < N
    if GUARD:  # compared as vectors: the interpreter mis-types a vector & a scalar bool
        row_ok = row_ok & ((rows * 0 + e) < NUM_EXPERTS)
        col_ok = col_ok & ((cols * 0 + e) < NUM_EXPERTS)
        e = tl.minimum(e, NUM_EXPERTS - 1)
    x_rows = rows
    if GATHER_K > 0:
        x_rows = tl.load(order_ptr + rows, mask=row_ok, other=0) // GATHER_K
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se + (cols // 128) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _k_step(acc, k0, x_ptr, xs_ptr, s_base, w_base, x_rows, cols, row_ok, col_ok, K, stride_xm,
                      stride_xs, stride_wn, BLOCK_K, A_FP8, PRECISION, UPCAST, W_FP8)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_fp8_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, N, K,
    stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, W_FP8: tl.constexpr = True,
    GATHER_K: tl.constexpr = 0,  # > 0: sorted row r reads x row order[r] // GATHER_K (the pair's token)
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < NUM_EXPERTS:
        _tile(e, pid_m, pid_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, N, K,
              stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_om, NUM_EXPERTS, BLOCK_M,
              BLOCK_N, BLOCK_K, A_FP8, PRECISION, UPCAST, W_FP8, GATHER_K, GUARD=False)


@triton.jit
def _grouped_persistent_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_row_end_ptr, order_ptr, N, K,
    num_m_tiles, stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, W_FP8: tl.constexpr,
    GATHER_K: tl.constexpr, COUNT_CHUNK: tl.constexpr,
):
    """The same tiles, P programs (the grid) each walking (M tile, N tile) items pid, pid + P,
    ..., with the item and K loops flattened into one, so the pipeliner's copies run ahead
    across item boundaries (a one-tile program starts and ends with an empty pipeline: at
    decode sizes an item is only K / BLOCK_K steps). P is read from the grid, not compiled in,
    so batch sizes with fewer items than P do not each build a kernel."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # The real M tiles are a prefix of the schedule (the rest name expert NUM_EXPERTS): count them.
    n_real = 0
    for c in range(0, num_m_tiles, COUNT_CHUNK):
        offs = c + tl.arange(0, COUNT_CHUNK)
        ex = tl.load(tile_expert_ptr + offs, mask=offs < num_m_tiles, other=NUM_EXPERTS)
        n_real += tl.sum((ex < NUM_EXPERTS).to(tl.int32))
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    for item in tl.range(pid, n_real * n_tiles_n, num_programs, flatten=True):
        pid_m = item // n_tiles_n
        # e < NUM_EXPERTS always holds for a prefix schedule: a guard as masks, not a branch
        e = tl.load(tile_expert_ptr + pid_m)
        _tile(e, pid_m, item % n_tiles_n, x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, tile_row0_ptr, tile_row_end_ptr,
              order_ptr, N, K, stride_xm, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_om,
              NUM_EXPERTS, BLOCK_M, BLOCK_N, BLOCK_K, A_FP8, PRECISION, UPCAST, W_FP8, GATHER_K, GUARD=True)


def tile_schedule(offs: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """offs [E] int32 group ends -> per M tile (expert, first row, row end), each [max_tiles]
    int32 with max_tiles = cdiv(R, block_m) + min(E, R); unused tiles get expert E."""
    num_experts = offs.shape[0]
    ends = offs.long()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    max_tiles = -(-num_rows // block_m) + min(num_experts, num_rows)
    pid = torch.arange(max_tiles, device=offs.device)
    expert = torch.searchsorted(tile_end, pid, right=True)  # the first expert whose tiles end after pid
    e = expert.clamp(max=num_experts - 1)
    row0 = ends[e] - counts[e] + (pid - (tile_end[e] - tiles[e])) * block_m
    return expert.int(), row0.int(), ends[e].int()


def fp8_activations_pay(x: torch.Tensor, num_experts: int) -> bool:
    """Whether to quantize the activations too (fp8 tensor cores): bfloat16 rows, K a whole
    number of 128-groups, and groups large enough (64 rows per expert on average) for the GEMM
    to be compute-bound. A first guess, to be tuned on the H200."""
    return x.dtype == torch.bfloat16 and x.shape[1] % BLOCK_K == 0 and x.shape[0] >= 64 * num_experts


def default_config(num_rows: int, num_experts: int, n: int, device, interpreter: bool,
                   half_experts: bool = False) -> dict:
    """Tiles from shapes only (no autotuning): 16-row M tiles for decode-sized groups (a few rows
    an expert: an expert's weights are read once per 16 of its rows), 64 past them; N tiles of
    64 where 128-wide ones would leave SMs idle (a decode-sized dense linear). bf16 / fp16
    experts (``half_experts``) in 16-row tiles take 64 x 256 (N x K): on an H100 (2026-12-07,
    ``kernels.py --only moe_bw``, V2-Lite gate_up at T=32, top-6) as fast as 128 x 128 over all
    64 experts (247 vs 246 us, 3.0 TB/s, the card's copy rate) and 14% faster when the rows
    crowd 16 of them (67 vs 78 us): twice the programs, each weight row read in 512-byte runs.
    fp8 experts keep K steps of 128 (one scale block). ``PERSISTENT`` (0: off) > 0 runs that many
    programs an SM over flattened item and K loops (:func:`_grouped_persistent_kernel`); opt-in
    until an H200 run says whether it reads faster."""
    if interpreter:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": BLOCK_K, "num_warps": 4, "num_stages": 1, "PERSISTENT": 0}
    block_m = 16 if num_rows <= 4 * num_experts else 64
    if half_experts and block_m == 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "PERSISTENT": 0}
    tiles = -(-num_rows // block_m) + min(num_experts, num_rows)
    block_n = 64 if tiles * triton.cdiv(n, 128) < 2 * hardware(device).num_sms else 128
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K, "num_warps": 4, "num_stages": 3,
            "PERSISTENT": 0}


def half_experts(w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """bf16 / fp16 experts (no fp8 scales): the ones :func:`default_config`'s long-K tile is for."""
    return scale is None and w.element_size() == 2


def config_for(num_rows: int, num_experts: int, n: int, device, override: dict | None,
               half_experts: bool = False) -> dict:
    """:func:`default_config` with ``override``'s keys in its place, checked: unknown keys and
    tiles that are not powers of two >= 16 raise (BLOCK_M must match the tile schedule's).
    BLOCK_K other than 128 is for float experts only (:func:`run_tiles` refuses it with fp8
    weights or activations: their scales are per 128 columns)."""
    config = default_config(num_rows, num_experts, n, device, interpreted(_grouped_fp8_kernel), half_experts)
    unknown = set(override or {}) - set(config)
    if unknown:
        raise ValueError(f"grouped GEMM config: unknown keys {sorted(unknown)}; known: {sorted(config)}")
    config.update(override or {})
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = config[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"grouped GEMM config: {key} must be a power of two >= 16, got {v}")
    if not isinstance(config["PERSISTENT"], int) or config["PERSISTENT"] < 0:
        raise ValueError(f"grouped GEMM config: PERSISTENT must be an int >= 0 (programs an SM), "
                         f"got {config['PERSISTENT']!r}")
    return config


def run_tiles(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, schedule, out_rows: int, config: dict,
              order: torch.Tensor | None = None, top_k: int = 1, quantize_activations: bool = False) -> torch.Tensor:
    """The grouped GEMM over a tile schedule made beforehand ((expert, row0, row_end) per tile, of
    ``config["BLOCK_M"]`` rows: :func:`tile_schedule` or :func:`.moe_sort.sort_pairs`) -> [out_rows, N]
    in x's dtype. w [E, N, K]: e4m3 with ``scale`` [E, ceil(N/128), ceil(K/128)], or floats in x's
    dtype (``scale`` None). ``order`` (with ``top_k``): sorted row r reads x's row order[r] // top_k,
    so x is the batch's hidden states [T, K], not a sorted copy of them."""
    num_experts, n = w.shape[:2]
    k = x.shape[1]
    out_dtype = x.dtype
    x = x if x.stride(1) == 1 else x.contiguous()
    w_fp8 = scale is not None
    x_scale = x.new_empty(0, dtype=torch.float32)  # unused without quantize_activations
    if quantize_activations:
        x8, x_scale = quantize_1x128(x)
        x = x8.view(torch.uint8)
    if w_fp8:
        w = w.view(torch.uint8)
    if w.stride(2) != 1:
        w = w.contiguous()
    no_scale = x_scale.new_empty(0)
    s = scale if w_fp8 else no_scale
    out = torch.empty(out_rows, n, dtype=out_dtype, device=x.device)
    expert, row0, row_end = schedule
    if out_rows == 0 or expert.shape[0] == 0:
        return out
    block_k = config.get("BLOCK_K", BLOCK_K)
    if block_k != BLOCK_K and (w_fp8 or quantize_activations):
        raise ValueError(f"grouped GEMM config: BLOCK_K must be {BLOCK_K} (one scale block) for fp8 weights or "
                         f"activations, got {block_k}")
    in_interpreter = interpreted(_grouped_fp8_kernel)
    common = dict(NUM_EXPERTS=num_experts, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k,
                  A_FP8=quantize_activations, PRECISION="ieee" if out_dtype == torch.float32 else "tf32",
                  UPCAST=in_interpreter, W_FP8=w_fp8, GATHER_K=top_k if order is not None else 0,
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    if config.get("PERSISTENT", 0):
        # a fixed grid (shapes only): PERSISTENT programs an SM, or fewer where there are fewer items
        items = expert.shape[0] * triton.cdiv(n, config["BLOCK_N"])
        programs = max(1, min(items, config["PERSISTENT"] * hardware(x.device).num_sms))
        _grouped_persistent_kernel[(programs,)](
            x, x_scale, w, s, out, expert, row0, row_end, order if order is not None else expert, n, k,
            expert.shape[0], x.stride(0), x_scale.stride(0) if quantize_activations else 0, w.stride(0), w.stride(1),
            s.stride(0) if w_fp8 else 0, s.stride(1) if w_fp8 else 0, out.stride(0),
            COUNT_CHUNK=min(1024, triton.next_power_of_2(expert.shape[0])), **common)
        return out
    grid = (expert.shape[0], triton.cdiv(n, config["BLOCK_N"]))
    _grouped_fp8_kernel[grid](
        x, x_scale, w, s, out, expert, row0, row_end, order if order is not None else expert, n, k,
        x.stride(0), x_scale.stride(0) if quantize_activations else 0, w.stride(0), w.stride(1),
        s.stride(0) if w_fp8 else 0, s.stride(1) if w_fp8 else 0, out.stride(0), **common,
    )
    return out


def _grouped(x, w, scale, offs, quantize_activations, config):
    check_runnable("moe", _grouped_fp8_kernel, x, namespace="mlagraph")
    cfg = config_for(x.shape[0], w.shape[0], w.shape[1], x.device, config, half_experts=half_experts(w, scale))
    schedule = tile_schedule(offs, x.shape[0], cfg["BLOCK_M"])
    return run_tiles(x, w, scale, schedule, x.shape[0], cfg, quantize_activations=quantize_activations)


def grouped_fp8_mm(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, quantize_activations: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """x [R, K] (rows sorted by expert, float32/bfloat16/float16), w [E, N, K] e4m3, scale
    [E, ceil(N/128), ceil(K/128)] float32, offs [E] int32 group ends (offs[-1] == R) -> [R, N]
    in x's dtype. ``quantize_activations`` (K % 128 == 0): x quantized per 1x128 group to e4m3
    first, as DeepSeek's fp8 GEMM does (adds e4m3's rounding of x). ``config``: tile overrides
    (BLOCK_M, BLOCK_N, num_warps, num_stages; benchmarks/kernels.py --sweep)."""
    return _grouped(x, w, scale, offs, quantize_activations, config)


def grouped_float_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``F.grouped_mm(x, w.transpose(1, 2), offs=offs)`` by the same tile schedule and kernel,
    for float experts: x [R, K] (rows sorted by expert), w [E, N, K] in x's dtype, offs [E] int32
    group ends -> [R, N] in x's dtype."""
    return _grouped(x, w, None, offs, False, config)
