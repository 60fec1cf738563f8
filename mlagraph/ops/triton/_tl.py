"""Triton helpers shared by the attention kernels."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation. UPCAST (set under Triton's CPU interpreter, whose dot
    multiplies bfloat16 operands as their raw uint16 bits) converts the operands to float32
    first: exact, since a product of two 16-bit floats is exact in float32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
