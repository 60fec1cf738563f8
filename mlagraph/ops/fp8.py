"""DeepSeek's fp8 block-scaled weights, and ``fp8_linear``: a linear layer that keeps them in fp8.

DeepSeek's checkpoints store a weight ``W`` [N, K] as e4m3 with ``weight_scale_inv``
[ceil(N/128), ceil(K/128)] float32, one scale per 128x128 block (the last blocks may be
partial): ``W_real = W_fp8 * scale`` blockwise. Routed experts stack those per expert:
[E, N, K] with scales [E, ceil(N/128), ceil(K/128)].

``fp8_linear`` computes ``x @ W_real.T``. The reference (every device) dequantizes the stored
weight per call and runs a plain matmul in x's dtype. On CUDA:

- more than ``W8A16_MAX_ROWS`` rows of bfloat16 ``x`` with 128-aligned N and K (compute-bound
  sizes): ``x`` quantized per 1x128 group and one block-scaled fp8 GEMM (``F.scaled_mm`` with
  BlockWise1x128 x BlockWise128x128, torch 2.11+), output bfloat16;
- otherwise (decode-sized, memory-bound calls, and ragged shapes): the Triton grouped fp8 GEMM
  of the MoE experts with a single group, which reads each weight once, as e4m3, and keeps
  ``x`` in its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_tensor
from ._define import custom_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite e4m3fn
LINEAR_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows the CUDA fp8_linear reads the weights (Triton, activations unquantized):
# scaled_mm was no faster than bf16 at M = 32 on the H200 (ANCHORS.md). To be tuned there.
W8A16_MAX_ROWS = 64


def block_grid(rows, cols) -> tuple:
    """Scale grid of a [rows, cols] weight: (ceil(rows/128), ceil(cols/128)); SymInt-safe."""
    return ((rows + FP8_BLOCK - 1) // FP8_BLOCK, (cols + FP8_BLOCK - 1) // FP8_BLOCK)


def check_block_scaled(op: str, w_arg: str, w, s_arg: str, s, *, shape, device) -> None:
    """An e4m3 weight of ``shape`` [..., N, K] and its float32 scales [..., ceil(N/128), ceil(K/128)]."""
    check_tensor(op, w_arg, w, shape=shape, dtypes=(FP8_DTYPE,), device=device)
    *lead, n, k = w.shape
    check_tensor(op, s_arg, s, shape=(*lead, *block_grid(n, k)), dtypes=(torch.float32,), device=device)


# An expert stack dequantizes a few experts at a time so that its float32 temporaries (the
# widened bytes and the expanded scales) stay near this many elements each: done whole, all 256
# of DeepSeek-V3's gate_up experts would need two 28 GiB temporaries beside the result.
DEQUANTIZE_CHUNK_ELEMS = 1 << 27


def dequantize_blockwise(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [..., N, K] times its 128x128 block scales [..., ceil(N/128), ceil(K/128)] -> dtype."""
    if w.dim() == 3 and w.shape[0] > 1 and w.numel() > DEQUANTIZE_CHUNK_ELEMS:
        per = max(1, DEQUANTIZE_CHUNK_ELEMS // (w.shape[1] * w.shape[2]))
        out = torch.empty(w.shape, dtype=dtype, device=w.device)
        for e in range(0, w.shape[0], per):
            out[e : e + per] = _dequantize(w[e : e + per], scale[e : e + per], dtype)
        return out
    return _dequantize(w, scale, dtype)


def _dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = w.shape[-2:]
    s = scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return (w.float() * s).to(dtype)


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek quantizes: w [..., N, K] float -> (e4m3 [..., N, K], scales
    [..., ceil(N/128), ceil(K/128)] float32 = block amax / 448). Used by tests and benchmarks."""
    *lead, n, k = w.shape
    gn, gk = block_grid(n, k)
    padded = w.float().new_zeros(*lead, gn * FP8_BLOCK, gk * FP8_BLOCK)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, gn, FP8_BLOCK, gk, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., gn, gk]
    q = (blocks / scale[..., :, None, :, None]).to(FP8_DTYPE).view(*lead, gn * FP8_BLOCK, gk * FP8_BLOCK)
    return q[..., :n, :k].contiguous(), scale


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] (K % 128 == 0) -> (e4m3 [M, K], scales [M, K/128] float32), one
    scale per row per 128 columns: the activation side of DeepSeek's fp8 GEMM."""
    m, k = x.shape
    groups = x.float().view(m, k // FP8_BLOCK, FP8_BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (groups / scale[..., None]).to(FP8_DTYPE).view(m, k), scale


def _check_fp8_linear(x, weight, weight_scale_inv) -> None:
    op = "fp8_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=LINEAR_DTYPES)
    check_block_scaled(
        op, "weight", weight, "weight_scale_inv", weight_scale_inv, shape=(None, x.shape[1]), device=x.device
    )


@custom_op("mlagraph::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32/bfloat16, weight [N, K] e4m3, weight_scale_inv [ceil(N/128), ceil(K/128)]
    float32 -> [M, N] in x's dtype: ``x @ dequantize(weight).T`` (dequantized per call)."""
    _check_fp8_linear(x, weight, weight_scale_inv)
    return F.linear(x, dequantize_blockwise(weight, weight_scale_inv, x.dtype))


def _blockwise_scaled_mm():
    """torch's block-scaled fp8 GEMM, or None on a torch without it (before 2.11)."""
    scaled_mm, scaling = getattr(F, "scaled_mm", None), getattr(F, "ScalingType", None)
    if scaled_mm is None or scaling is None or not hasattr(scaling, "BlockWise128x128"):
        return None
    return scaled_mm, scaling


def fp8_gemm_applies(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether the CUDA fp8 GEMM takes this call: bfloat16 activations, 128-aligned N and K
    (the scale grids then tile exactly), and a torch that has the block-scaled ``scaled_mm``."""
    aligned = n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0
    return x.dtype == torch.bfloat16 and aligned and _blockwise_scaled_mm() is not None


@fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x, weight, weight_scale_inv):
    _check_fp8_linear(x, weight, weight_scale_inv)
    n, k = weight.shape
    if x.shape[0] <= W8A16_MAX_ROWS or not fp8_gemm_applies(x, n, k):
        from .triton.grouped_fp8 import grouped_fp8_mm  # Triton is imported only where it runs

        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)  # one group: every row
        return grouped_fp8_mm(x, weight[None], weight_scale_inv[None], offs)
    scaled_mm, scaling = _blockwise_scaled_mm()
    x8, x_scale = quantize_1x128(x)
    # scaled_mm wants the activation scales [M, K/128] column-major and the weight's
    # [N/128, K/128] scales transposed along with the weight (ANCHORS.md, measured on the H200).
    return scaled_mm(
        x8, weight.t(), x_scale.t().contiguous().t(), scaling.BlockWise1x128, weight_scale_inv.t(),
        scaling.BlockWise128x128, output_dtype=torch.bfloat16,
    )


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, weight_scale_inv):
    _check_fp8_linear(x, weight, weight_scale_inv)
    return x.new_empty(x.shape[0], weight.shape[0])

