"""What every Triton kernel launcher shares (ours, and aiter's behind our ops): where a kernel can run."""

from __future__ import annotations

import torch
from ._hardware import interpreted


def check_runnable(op: str, kernel, tensor: torch.Tensor, namespace: str = "mlagraph_triton",
                   when: str = "before the first triton-backend call") -> None:
    """A compiled kernel needs CUDA tensors; an interpreted one (TRITON_INTERPRET=1 when it was
    defined: ``when`` says when that is for this backend) runs on CPU tensors too."""
    if tensor.device.type == "cuda" or interpreted(kernel):
        return
    raise ValueError(
        f"{namespace}.{op}: argument tensors: expected CUDA tensors (or TRITON_INTERPRET=1 set "
        f"{when}, to run Triton's interpreter on CPU), got device {tensor.device}"
    )
