"""Keeping DeepSeek's fp8 block-scaled weights in fp8 inside the model.

``from_pretrained(fp8_weights=...)`` decides, once, whether an fp8 checkpoint's e4m3 weights stay
e4m3 (:func:`keeps_fp8`). Kept weights live in buffers named like the checkpoint tensors
(``X.weight`` e4m3 and ``X.weight_scale_inv`` float32), so ``state_dict()`` still equals the
checkpoint and ``to_device_dtype`` (which casts parameters only) leaves them fp8:

- a linear layer becomes an :class:`Fp8Linear` (``mlagraph::fp8_linear``);
- a MoE layer's stacked experts become e4m3 ``gate_up_proj`` / ``down_proj`` with
  ``gate_up_proj_scale_inv`` [E, 2I/128, ceil(D/128)] / ``down_proj_scale_inv`` [E, ceil(D/128), I/128].

Weights the model reads directly instead of calling the layer stay in the model dtype
(dequantized at load): ``kv_b_proj``, whose weight MLA splits per head and absorbs into q and
out, and the indexer's float32 ``weights_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fp8 import FP8_BLOCK, FP8_DTYPE, LINEAR_DTYPES, block_grid

FP8_WEIGHT_CHOICES = ("auto", "keep", "dequantize")
# Linear layers whose .weight the model reads itself (see the module docstring).
DEQUANTIZED_AT_LOAD = ("kv_b_proj", "weights_proj")


class Fp8Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W [N, K] e4m3 and its [ceil(N/128), ceil(K/128)] scales."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale_inv", torch.ones(block_grid(out_features, in_features)))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        y = torch.ops.mlagraph.fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


def keeps_fp8(choice: str, hf_config: dict, has_fp8_weights: bool, dtype: torch.dtype) -> bool:
    """Whether a checkpoint's fp8 weights stay fp8.

    ``choice``: "auto" keeps them when config.json declares DeepSeek's fp8 quantization
    (``quantization_config.quant_method == "fp8"``); "keep" insists (errors if it cannot);
    "dequantize" turns them into ``dtype`` at load, as mlagraph did before.
    """
    if choice not in FP8_WEIGHT_CHOICES:
        raise ValueError(f"from_pretrained: fp8_weights: expected one of {FP8_WEIGHT_CHOICES}, got {choice!r}")
    if choice == "dequantize" or not has_fp8_weights and choice == "auto":
        return False
    if not has_fp8_weights:
        raise ValueError(
            "from_pretrained: fp8_weights='keep': the checkpoint has no fp8 weights (no *weight_scale_inv)"
        )
    qc = hf_config.get("quantization_config")
    if qc is None or qc.get("quant_method") != "fp8":
        if choice == "auto":
            return False
    else:
        block = list(qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
        fmt = qc.get("fmt", "e4m3")
        if block != [FP8_BLOCK, FP8_BLOCK] or fmt != "e4m3":
            raise ValueError(
                "from_pretrained: quantization_config: expected fmt 'e4m3' with weight_block_size "
                f"[{FP8_BLOCK}, {FP8_BLOCK}] to keep fp8 weights, got fmt {fmt!r}, weight_block_size {block}; "
                "pass fp8_weights='dequantize'"
            )
    if dtype not in LINEAR_DTYPES:
        raise ValueError(f"from_pretrained: fp8_weights={choice!r} runs in float32 or bfloat16, got dtype {dtype}")
    return True


def slice_keeps_blocks(sl: tuple[int, int, int] | None) -> bool:
    """Whether every rank's slice of an fp8 weight is made of whole 128x128 scale blocks, so
    each rank can keep its slice in fp8 with the matching rows or columns of the scales. ``sl``:
    this rank's (dim, start, length) of an even split (every rank's length is the same, so the
    answer is too), or None for a weight every rank holds whole."""
    return sl is None or sl[2] % FP8_BLOCK == 0


def slice_scales(scale: torch.Tensor, sl: tuple[int, int, int]) -> torch.Tensor:
    """The block scales [N/128, K/128] of a weight slice (dim, start, length) that
    :func:`slice_keeps_blocks` accepted."""
    dim, start, n = sl
    return scale.narrow(dim, start // FP8_BLOCK, n // FP8_BLOCK)


def fp8_linear_for(linear: nn.Linear) -> Fp8Linear:
    """An Fp8Linear of the same shape (and the same bias parameter) to load fp8 weights into."""
    return Fp8Linear(linear.in_features, linear.out_features, linear.bias)


def keep_experts_fp8(experts: nn.Module) -> None:
    """Stacked experts (gate_up_proj [E, 2I, D], down_proj [E, D, I] parameters) -> e4m3
    buffers plus block scales. I must be a multiple of 128: gate and up are stacked along the
    rows, and a block straddling both would need two scales."""
    num_experts, two_inter, dim = experts.gate_up_proj.shape
    inter = two_inter // 2
    if inter % FP8_BLOCK != 0:
        raise ValueError(
            f"from_pretrained: fp8 experts: expected moe_intermediate_size divisible by {FP8_BLOCK} "
            f"(gate and up rows are stacked in whole 128-row blocks), got {inter}; pass fp8_weights='dequantize'"
        )
    device = experts.gate_up_proj.device
    del experts.gate_up_proj, experts.down_proj
    for name, (rows, cols) in (("gate_up_proj", (two_inter, dim)), ("down_proj", (dim, inter))):
        experts.register_buffer(name, torch.zeros(num_experts, rows, cols, dtype=FP8_DTYPE, device=device))
        experts.register_buffer(f"{name}_scale_inv", torch.ones(num_experts, *block_grid(rows, cols), device=device))
