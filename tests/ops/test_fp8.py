"""mlagraph.ops.fp8: DeepSeek's 128x128 block quantization, 1x128 activation quantization, and
mlagraph::fp8_linear against the dequantized product (CPU here; the CUDA fp8 GEMM under -m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlagraph.ops.fp8 import (
    FP8_DTYPE,
    W8A16_MAX_ROWS,
    dequantize_blockwise,
    fp8_gemm_applies,
    quantize_1x128,
    quantize_blockwise,
)
from tests import helpers

fp8_linear = torch.ops.mlagraph.fp8_linear


def _blockwise_loop(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantization one 128x128 block at a time (independent of the vectorised one), each
    product rounded to float32 as DeepSeek's (and our) dequantization does."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out.double()


@pytest.mark.parametrize("shape", [(272, 160), (128, 256), (48, 48)])
def test_quantize_blockwise_round_trip(shape):
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[1])  # blocks of very different magnitude
    q, scale = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == shape
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and scale.dtype == torch.float32
    deq = dequantize_blockwise(q, scale, torch.float32)
    torch.testing.assert_close(deq.double(), _blockwise_loop(q, scale), rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: <= 2^-4 relative, plus the subnormal step near 0
    s_full = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    err = (deq - w).abs()
    assert err.max() > 0 and torch.all(err <= 2**-4 * w.abs() + 2**-9 * s_full)
    # every block's largest entry maps to e4m3's largest finite value: no clipping, full range
    assert q.float().abs().max() == 448.0


@pytest.mark.parametrize("chunk", [1, 160 * 272, 3 * 160 * 272 - 1])  # an expert, exactly one, two a chunk
def test_expert_stacks_dequantize_in_chunks(monkeypatch, chunk):
    """A stack of experts [E, N, K] past DEQUANTIZE_CHUNK_ELEMS dequantizes a few experts at a
    time (V3's 256 experts whole would need 28 GiB temporaries): the same values as one by one."""
    import mlagraph.ops.fp8 as fp8

    q, scale = quantize_blockwise(torch.randn(5, 272, 160))
    monkeypatch.setattr(fp8, "DEQUANTIZE_CHUNK_ELEMS", chunk)
    got = dequantize_blockwise(q, scale, torch.bfloat16)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    for e in range(5):
        torch.testing.assert_close(got[e].double(), _blockwise_loop(q[e], scale[e]).bfloat16().double(), rtol=0, atol=0)


def test_quantize_1x128_round_trip():
    x = torch.randn(5, 384) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(128)
    q, scale = quantize_1x128(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 3)
    deq = (q.float().view(5, 3, 128) * scale[..., None]).view(5, 384)
    assert torch.all((deq - x).abs() <= 2**-4 * x.abs() + 2**-9 * scale.repeat_interleave(128, 1))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,k", [(272, 160), (256, 128), (48, 40)])
def test_fp8_linear_is_the_dequantized_product(n, k, dtype, tol):
    q, scale = quantize_blockwise(torch.randn(n, k) * k**-0.5)
    x = torch.randn(7, k + 3)[:, 1 : k + 1].to(dtype)  # a non-contiguous slice
    out = fp8_linear(x, q, scale)
    assert out.dtype == dtype and out.shape == (7, n)
    expected = x.double() @ _blockwise_loop(q, scale).T
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_opcheck(dtype):
    q, scale = quantize_blockwise(torch.randn(136, 160))
    helpers.opcheck(fp8_linear, (torch.randn(3, 160, dtype=dtype), q, scale))


def test_fp8_gemm_applies_only_to_aligned_bf16():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    has_api = hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise128x128")
    assert fp8_gemm_applies(x, 256, 256) == has_api
    assert not fp8_gemm_applies(x, 200, 256) and not fp8_gemm_applies(x, 256, 192)
    assert not fp8_gemm_applies(x.float(), 256, 256)


def _error_cases():
    q, scale = quantize_blockwise(torch.randn(272, 160))
    x = torch.randn(3, 160)
    return [
        ("x", (x[None], q, scale)),
        ("x", (x.half(), q, scale)),
        ("weight", (x[:, :-1], q, scale)),  # K mismatch is reported on the weight
        ("weight", (x, q.float(), scale)),
        ("weight", (x, q.to("meta"), scale)),
        ("weight_scale_inv", (x, q, scale[:-1])),
        ("weight_scale_inv", (x, q, scale.double())),
        ("weight_scale_inv", (x, q, scale[None])),
    ]


@pytest.mark.parametrize("arg,args", _error_cases())
def test_fp8_linear_bad_input(arg, args):
    helpers.assert_value_error(fp8_linear, args, helpers.arg_error(arg))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 1024])
@pytest.mark.parametrize("n,k", [(7168, 2048), (1536, 7168), (576, 7168), (272, 160)])
def test_fp8_linear_cuda_matches_dequantized(m, n, k):
    """The block-scaled fp8 GEMM (aligned shapes, M > W8A16_MAX_ROWS) or the weight-only kernel
    (ragged shapes, decode rows) on CUDA against float32 products of dequantized operands. The
    fp8 GEMM also quantizes the activations per 1x128 (W8A8): against the quantized operands'
    product it is exact up to bf16 output rounding (1e-2), and against the unquantized
    activations it carries e4m3's rounding of them, 2.6% relative for normal activations
    (measured: this test's inputs give 0.0257 on CPU and on the H200), so 3.5e-2 there."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    q, scale = quantize_blockwise(w)
    w_deq = dequantize_blockwise(q, scale, torch.float32)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    out = fp8_linear(x, q, scale)
    assert out.dtype == torch.bfloat16
    w8a8 = m > W8A16_MAX_ROWS and fp8_gemm_applies(x, n, k)
    x_used = x.float()
    if w8a8:
        x8, x_scale = quantize_1x128(x)
        x_used = (x8.float().view(m, k // 128, 128) * x_scale[..., None]).view(m, k)
    exact = x_used @ w_deq.T
    assert ((out.float() - exact).norm() / exact.norm()) < 1e-2
    unquantized = x.float() @ w_deq.T
    rel = (out.float() - unquantized).norm() / unquantized.norm()
    assert rel < (3.5e-2 if w8a8 else 1e-2), rel
    graph, captured = helpers.capture_cuda_graph(lambda: fp8_linear(x, q, scale))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, fp8_linear(x, q, scale), rtol=0, atol=0)
