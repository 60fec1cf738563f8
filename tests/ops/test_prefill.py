"""mha_prefill against an independent float64 loop over requests, queries, heads and keys."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import mlagraph  # noqa: F401  (registers torch.ops.mlagraph.*)
from tests.helpers import arg_error, assert_value_error

mha_prefill = torch.ops.mlagraph.mha_prefill

H, DQK, DV = 2, 24, 16
SM_SCALE = 0.2


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def make_qkv(q_lens, k_lens, dtype=torch.float32, pad_q: int = 0, pad_k: int = 0, seed: int = 0):
    """q [T, H, DQK], k [S, H, DQK], v [S, H, DV] as non-contiguous slices (like the model's splits);
    pad_q / pad_k extra rows past the last request stand for padding tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens) + pad_q, H, DQK + 8, generator=g).to(dtype)[..., :DQK]
    kv = torch.randn(sum(k_lens) + pad_k, H, DQK + DV, generator=g).to(dtype)
    return q, kv[..., :DQK], kv[..., DQK:]


def ref_prefill(q, k, v, q_lens, k_lens, sm_scale, causal):
    """Request by request, query by query, head by head, softmax by hand in float64."""
    out = torch.zeros(q.shape[0], H, DV, dtype=torch.float64)
    lse = torch.full((q.shape[0], H), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for n_q, n_k in zip(q_lens, k_lens):
        for i in range(n_q):
            n_vis = min(n_k, i + (n_k - n_q) + 1) if causal else n_k  # keys j <= i + (len_k - len_q)
            for h in range(H):
                if n_vis <= 0:
                    continue
                qv = q[q0 + i, h].double()
                scores = [sm_scale * float(qv @ k[k0 + j, h].double()) for j in range(n_vis)]
                m = max(scores)
                z = sum(math.exp(s - m) for s in scores)
                out[q0 + i, h] = sum((math.exp(s - m) / z) * v[k0 + j, h].double() for j, s in enumerate(scores))
                lse[q0 + i, h] = m + math.log(z)
        q0, k0 = q0 + n_q, k0 + n_k
    return out, lse


# name -> (q_lens, k_lens, causal, pad_q, pad_k)
CASES = {
    "no_prefix": ([3, 5, 1], [3, 5, 1], True, 0, 0),
    "prefix": ([3, 5, 2], [7, 5, 10], True, 0, 0),
    "non_causal": ([3, 4], [6, 2], False, 0, 0),
    "empty_middle_request": ([3, 0, 4], [3, 5, 6], True, 0, 0),
    "padding_tokens": ([2, 3], [4, 3], True, 2, 1),
    "fewer_keys_than_queries": ([4], [2], True, 0, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_loop(case):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    q, k, v = make_qkv(q_lens, k_lens, pad_q=pad_q, pad_k=pad_k)
    out, lse = mha_prefill(q, k, v, cu(q_lens), cu(k_lens), SM_SCALE, causal)
    assert out.shape == (q.shape[0], H, DV) and out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse = ref_prefill(q, k, v, q_lens, k_lens, SM_SCALE, causal)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any() and not lse.isnan().any()


def test_padding_and_unseen_queries_are_zero():
    q, k, v = make_qkv([2, 3], [4, 3], pad_q=2, pad_k=1)
    out, lse = mha_prefill(q, k, v, cu([2, 3]), cu([4, 3]), SM_SCALE, True)
    assert torch.all(out[5:] == 0) and torch.all(lse[5:] == -math.inf)
    q, k, v = make_qkv([4], [2])  # query i sees keys j <= i - 2: the first two see nothing
    out, lse = mha_prefill(q, k, v, cu([4]), cu([2]), SM_SCALE, True)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == -math.inf) and torch.all(lse[2:] > -math.inf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q_lens, k_lens = [3, 5, 2], [7, 5, 10]
    q, k, v = make_qkv(q_lens, k_lens, dtype=dtype)
    out, lse = mha_prefill(q, k, v, cu(q_lens), cu(k_lens), SM_SCALE, True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = ref_prefill(q, k, v, q_lens, k_lens, SM_SCALE, True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-2, rtol=1.6e-2)  # out rounded to q's dtype
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # lse stays float32


def test_prefix_of_one_request_is_its_own():
    """Keys of other requests never leak in: changing request 0's keys leaves request 1 alone."""
    q_lens, k_lens = [2, 3], [4, 6]
    q, k, v = make_qkv(q_lens, k_lens)
    out, lse = mha_prefill(q, k, v, cu(q_lens), cu(k_lens), SM_SCALE, True)
    k2, v2 = k.clone(), v.clone()
    k2[:4] += 1.0
    v2[:4] -= 1.0
    out2, lse2 = mha_prefill(q, k2, v2, cu(q_lens), cu(k_lens), SM_SCALE, True)
    assert torch.equal(out[2:], out2[2:]) and torch.equal(lse[2:], lse2[2:])
    assert not torch.equal(out[:2], out2[:2])


# ---------------------------------------------------------------------------------------------
# opcheck, compile


def prefill_args(case="prefix", dtype=torch.float32):
    q_lens, k_lens, causal, pad_q, pad_k = CASES[case]
    q, k, v = make_qkv(q_lens, k_lens, dtype=dtype, pad_q=pad_q, pad_k=pad_k)
    return [q, k, v, cu(q_lens), cu(k_lens), SM_SCALE, causal]


@pytest.mark.parametrize(
    "case,dtype",
    [("prefix", torch.float32), ("non_causal", torch.bfloat16), ("empty_middle_request", torch.float32),
     ("padding_tokens", torch.float16)],
    ids=["prefix-f32", "non_causal-bf16", "empty_middle_request-f32", "padding_tokens-f16"],
)
def test_opcheck(case, dtype):
    torch.library.opcheck(mha_prefill, prefill_args(case, dtype))


def test_compile_matches_eager():
    def step(q, k, v, cu_q, cu_k):
        out, lse = mha_prefill(q, k, v, cu_q, cu_k, SM_SCALE, True)
        return out + 1, lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for case in ["prefix", "empty_middle_request"]:
        args = prefill_args(case)[:5]
        for got, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# bad input

ARGS = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "softmax_scale", "causal"]

BAD = [
    ("q", lambda a: a.update(q=a["q"][0])),  # 2-d
    ("q", lambda a: a.update(q=a["q"].to(torch.int32))),
    ("k", lambda a: a.update(k=a["k"][:, :1])),  # heads differ from q
    ("k", lambda a: a.update(k=a["k"][..., :-1])),  # head dim differs from q
    ("k", lambda a: a.update(k=a["k"].to(torch.bfloat16))),
    ("k", lambda a: a.update(k=a["k"].to("meta"))),
    ("v", lambda a: a.update(v=a["v"][:-1])),  # k / v length mismatch
    ("v", lambda a: a.update(v=a["v"][:, :1])),
    ("v", lambda a: a.update(v=a["v"].double())),
    ("v", lambda a: a.update(v=a["v"][0])),  # 2-d
    ("v", lambda a: a.update(v=a["v"].to("meta"))),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long())),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][None])),  # 2-d
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:0], cu_seqlens_k=a["cu_seqlens_k"][:0])),
    ("cu_seqlens_q", lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].to("meta"))),
    ("cu_seqlens_k", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:-1])),  # length mismatch
    ("cu_seqlens_k", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].long())),
    ("cu_seqlens_k", lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].to("meta"))),
    ("softmax_scale", lambda a: a.update(softmax_scale=0.0)),
    ("softmax_scale", lambda a: a.update(softmax_scale=-1.0)),
]


@pytest.mark.parametrize("arg,mutate", BAD, ids=[f"{i}-{arg}" for i, (arg, _) in enumerate(BAD)])
def test_bad_input(arg, mutate):
    a = dict(zip(ARGS, prefill_args()))
    mutate(a)
    assert_value_error(mha_prefill, [a[n] for n in ARGS], arg_error(arg))


# ---------------------------------------------------------------------------------------------
# single_request: the caller's statement that a backend may run a dense kernel


def test_single_request_gives_the_same_result():
    q, k, v = make_qkv([7], [7])
    want = mha_prefill(q, k, v, cu([7]), cu([7]), SM_SCALE, True)
    got = mha_prefill(q, k, v, cu([7]), cu([7]), SM_SCALE, True, single_request=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("q_lens,k_lens,causal", [([3, 4], [3, 4], True), ([3], [5], True), ([4], [4], False)],
                         ids=["two_requests", "prefix", "not_causal"])
def test_single_request_refused_where_it_does_not_hold(q_lens, k_lens, causal):
    q, k, v = make_qkv(q_lens, k_lens)
    assert_value_error(mha_prefill, [q, k, v, cu(q_lens), cu(k_lens), SM_SCALE, causal, True],
                       arg_error("single_request"))
