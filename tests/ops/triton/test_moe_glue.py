"""The grouped MoE path's fused glue (mlagraph/ops/triton/moe_glue.py) against the generic op's
torch functions of the same names, and the float64 formula: the same roundings, remote rows
kept out even when they hold NaN, empty batches (CPU through Triton's interpreter; CUDA under
-m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlagraph.ops import moe as generic
from mlagraph.ops.triton import moe_glue

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 8), (7, 40), (33, 100)])
def test_silu_mul(device, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype).to(device)
    got = moe_glue.silu_mul(gate_up, dtype)
    want = generic.silu_mul(gate_up, dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    assert got.shape == (rows, inter) and got.dtype == dtype
    # Both round a float32 result once: at most one unit in the last place apart.
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-22}[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=ulp, atol=ulp)
    torch.testing.assert_close(got.double(), exact, rtol=2 * ulp, atol=2 * ulp)


def test_silu_mul_strided_input(device):
    """A row-strided view (a slice of a wider buffer) reads the right columns."""
    wide = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(device)
    gate_up = wide[:, :48]
    torch.testing.assert_close(moe_glue.silu_mul(gate_up, torch.float32), generic.silu_mul(gate_up, torch.float32))


def _sorted_rows(num_tokens, top_k, num_experts, dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(num_experts, (num_tokens, top_k), generator=gen)
    order = torch.argsort(ids.reshape(-1), stable=True)
    y = torch.randn(num_tokens * top_k, dim, generator=gen).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return y.to(device), order.to(device), weights.to(device), ids.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,top_k,dim", [(1, 1, 16), (3, 6, 40), (17, 8, 72)])
def test_unsort_combine(device, dtype, num_tokens, top_k, dim):
    y, order, weights, _ = _sorted_rows(num_tokens, top_k, 8, dim, dtype, device, seed=dim)
    got = moe_glue.unsort_combine(y, order, weights, None, dtype)
    want = generic.unsort_combine(y, order, weights, None, dtype)
    # The float64 formula: token t's pair j sits at the sorted row where order == t*k + j.
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    exact = (y.double()[row_of].view(num_tokens, top_k, dim) * weights.double()[..., None]).sum(1)
    assert got.shape == (num_tokens, dim) and got.dtype == dtype
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=ulp, atol=ulp)
    torch.testing.assert_close(got.double(), exact, rtol=2 * ulp, atol=2 * ulp)


def test_remote_rows_add_nothing_even_when_nan(device):
    """Expert parallel: rows of another rank's experts hold what the GEMM left (NaN here)."""
    y, order, weights, ids = _sorted_rows(6, 4, 8, 24, torch.bfloat16, device, seed=3)
    remote = (ids >= 5).reshape(-1)
    assert remote.any() and not remote.all()
    y[remote[order]] = float("nan")  # the sorted rows of remote pairs
    got = moe_glue.unsort_combine(y, order, weights, remote, torch.bfloat16)
    want = generic.unsort_combine(y, order, weights, remote, torch.bfloat16)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


def test_empty_batch(device):
    y = torch.empty(0, 16, device=device)
    order = torch.empty(0, dtype=torch.int64, device=device)
    out = moe_glue.unsort_combine(y, order, torch.empty(0, 6, device=device), None, torch.float32)
    assert out.shape == (0, 16)
    assert moe_glue.silu_mul(torch.empty(0, 32, device=device), torch.float32).shape == (0, 16)


def test_cpu_tensors_without_the_interpreter_name_the_op(monkeypatch):
    monkeypatch.setattr(moe_glue, "interpreted", lambda kernel: False)
    monkeypatch.setattr("mlagraph.ops.triton._launch.interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match=r"mlagraph_triton\.moe: argument tensors: expected CUDA tensors"):
        moe_glue.silu_mul(torch.zeros(2, 8), torch.float32)
