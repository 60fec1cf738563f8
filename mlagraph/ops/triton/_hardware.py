"""Hardware facts every kernel config reads, from one place: SM count, shared memory a block may
use, and whether a kernel runs in Triton's CPU interpreter.

On CPU there is no device to ask: kernels run in the interpreter, and the facts answered are an
H200's, so the CPU suite shapes grids and tiles as the H200 does (a config bug that only shows
at the H200's sizes shows in CI too).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.runtime.interpreter import InterpretedFunction

H200_SMS = 132
H200_SHARED_MEMORY = 227 * 1024  # bytes a block may opt into on sm_90


@dataclasses.dataclass(frozen=True)
class Hardware:
    num_sms: int
    shared_memory_per_block: int  # bytes, the opt-in maximum


@functools.lru_cache(maxsize=None)
def hardware(device: torch.device) -> Hardware:
    """The facts of ``device`` (a CUDA device), or an H200's for CPU tensors (interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return Hardware(H200_SMS, H200_SHARED_MEMORY)
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None) or H200_SHARED_MEMORY
    return Hardware(props.multi_processor_count, int(smem))


def interpreted(kernel) -> bool:
    """Does this ``@triton.jit`` kernel run in Triton's interpreter? (Triton decides when the
    kernel is defined: TRITON_INTERPRET=1 at that time.)"""
    return isinstance(kernel, InterpretedFunction)
