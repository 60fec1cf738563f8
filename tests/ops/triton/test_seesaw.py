"""The seesaw schedule's recurrence (mlagraph/ops/triton/seesaw.py) in float64 against
plain softmax attention: the kernel needs a Hopper GPU (its GPU tests are in test_decode.py), but
the order in which it rescales the two output halves, the two blocks' P and the row sums is
arithmetic that runs anywhere. Each line below is one step of the kernel's warp groups."""

from __future__ import annotations

import math

import pytest
import torch

BN = 64


def _safe(m):
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def seesaw(s, v):
    """s [rows, n] base-2 scores (-inf: masked), v [n, L] -> (out [rows, L], lse2 [rows]), blocks of
    64 keys taken in pairs as seesaw's warp groups take them."""
    rows, n = s.shape
    half = v.shape[1] // 2
    m = torch.full((rows,), float("-inf"), dtype=s.dtype)
    l_i = torch.zeros(rows, dtype=s.dtype)
    o_l = torch.zeros(rows, half, dtype=s.dtype)
    o_r = torch.zeros(rows, half, dtype=s.dtype)
    for start in range(0, n, 2 * BN):
        s0, v0 = s[:, start:start + BN], v[start:start + BN]
        s1, v1 = s[:, start + BN:start + 2 * BN], v[start + BN:start + 2 * BN]  # empty: an odd last block
        # warp group 0: S0, its softmax, o_L's first product; sends m0, rowsum P0
        m0 = torch.maximum(m, s0.amax(1))
        p0 = torch.exp2(s0 - _safe(m0)[:, None])
        o_l = o_l * torch.exp2(m - _safe(m0))[:, None] + p0 @ v0[:, :half]
        # warp group 1: S1 (all -inf without a block), its softmax at m1 >= m0, o_R's first product
        s1_max = s1.amax(1) if s1.shape[1] else torch.full((rows,), float("-inf"), dtype=s.dtype)
        m1 = torch.maximum(m0, s1_max)
        p1 = torch.exp2(s1 - _safe(m1)[:, None])
        o_r = o_r * torch.exp2(m - _safe(m1))[:, None] + p1 @ v1[:, half:]
        # warp group 0: P0 to m1's scale (sent), o_L at m1 plus P1 V1_L; warp group 1: o_R += P0 V0_R
        scale1 = torch.exp2(m0 - _safe(m1))
        o_l = o_l * scale1[:, None] + p1 @ v1[:, :half]
        o_r = o_r + (p0 * scale1[:, None]) @ v0[:, half:]
        l_i = l_i * torch.exp2(m - _safe(m1)) + p0.sum(1) * scale1 + p1.sum(1)
        m = m1
    has_key = l_i > 0
    l_safe = torch.where(has_key, l_i, torch.ones_like(l_i))
    out = torch.cat([o_l, o_r], 1) / l_safe[:, None]
    return out, torch.where(has_key, m + torch.log2(l_safe), torch.full_like(m, float("-inf")))


@pytest.mark.parametrize("n", [1, 64, 100, 128, 200, 320, 512])
def test_seesaw_recurrence_is_softmax_attention(n):
    """Odd and even block counts, a partial last block, rows whose keys are all masked, rows that
    see their first key only in a later block (m = -inf until then), and rows whose scores rise
    along the keys, so that every block moves the max and every rescale matters."""
    g = torch.Generator().manual_seed(n)
    rows = 8
    s = torch.randn(rows, n, generator=g, dtype=torch.float64) * 30
    v = torch.randn(n, 16, generator=g, dtype=torch.float64)
    s[0] = float("-inf")  # no visible key
    s[1, : min(n - 1, 150)] = float("-inf")  # the first visible key late
    s[2, n // 2:] = float("-inf")  # causal-like: only the first half
    s[3, ::3] = float("-inf")
    s[4:] += torch.linspace(0, 200, n, dtype=s.dtype)  # rising: nearly every block raises the max
    out, lse = seesaw(s, v)

    visible = s > float("-inf")
    ref_lse = torch.logsumexp(s * math.log(2.0), 1) / math.log(2.0)
    weights = torch.where(visible, torch.exp2(s - ref_lse[:, None]), torch.zeros_like(s))
    ref = torch.nan_to_num(weights) @ v
    torch.testing.assert_close(out[1:], ref[1:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[1:], ref_lse[1:].to(lse.dtype), rtol=1e-12, atol=1e-12)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and lse[0] == float("-inf")
