"""float32 -> float8_e4m3fn rounding shared by the kernels that quantize (cache writes).

Triton's CPU interpreter converts float32 to e4m3 without carrying a mantissa overflow into the
exponent (31.8 becomes 16, not 32), so the kernels round to e4m3's grid themselves, in float32,
and only then convert. Every value handed to the conversion is then exactly representable, and
the result is round-to-nearest-even on the GPU and in the interpreter alike, which is also what
``torch.Tensor.to(torch.float8_e4m3fn)`` (the reference) does.
"""

import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def round_to_fp8_grid(x):
    """float32 -> the nearest e4m3 value (ties to even), still in float32, saturated to +-448."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    # Normal range: keep 3 of the 23 mantissa bits, round to nearest even through the bits.
    bits = x.to(tl.int32, bitcast=True)
    bias = ((bits >> 20) & 1) + 0x7FFFF
    normal = ((bits + bias) & -1048576).to(tl.float32, bitcast=True)  # -1048576 == ~0xFFFFF
    # Subnormal range (|x| < 2**-6): a multiple of 2**-9; float32 numbers near 1.5 * 2**14 are
    # spaced exactly 2**-9 apart, so adding and subtracting it rounds (ties to even) there. On
    # |x|, with x's sign bit put back by OR, so tiny negatives round to -0 as the reference's do
    # (a float negation would not do: Triton lowers -x as 0 - x, which gives +0 on the GPU).
    sub = (tl.abs(x) + 24576.0) - 24576.0
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def to_fp8_bits(x):
    """float32 -> e4m3 bit patterns as uint8 (for uint8-typed caches)."""
    return round_to_fp8_grid(x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def from_fp8_bits(b):
    """uint8 e4m3 bit patterns -> float32."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
