"""What every Triton kernel launcher shares: where a kernel can run."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_runnable(op: str, kernel, tensor: torch.Tensor) -> None:
    """A compiled kernel needs CUDA tensors; an interpreted one (TRITON_INTERPRET=1 when it was
    defined) runs on CPU tensors too."""
    if tensor.device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return
    raise ValueError(
        f"mlagraph_triton.{op}: argument tensors: expected CUDA tensors (or TRITON_INTERPRET=1 set "
        f"before the first triton-backend call, to run Triton's interpreter on CPU), got device "
        f"{tensor.device}"
    )
