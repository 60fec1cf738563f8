"""The one-launch router (mlagraph/ops/triton/route.py) against the generic op's torch routing:
the same experts and weights for every DeepSeek routing, at toy and real sizes, ties broken
toward the lower expert id, NaN logits kept inside the expert range (CPU through Triton's
interpreter; CUDA under -m gpu)."""

from __future__ import annotations

import pytest
import torch

from mlagraph.ops.moe import route as torch_route
from mlagraph.ops.triton.route import route
from tests.ops.test_moe import ROUTING_IDS, ROUTINGS

# (name, E, scoring, method, n_group, topk_group, top_k, norm, scale): DeepSeek's real routers
REAL = [
    ("v2_lite", 64, "softmax", "greedy", 1, 1, 6, False, 1.0),
    ("v2", 160, "softmax", "group_limited_greedy", 8, 3, 6, False, 16.0),
    ("v3", 256, "sigmoid", "noaux_tc", 8, 4, 8, True, 2.5),
]


def _sorted(weights, ids):
    """(weights, ids) in expert-id order per token: both routers' slot orders compared alike."""
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def _both(logits, bias, *routing):
    got = _sorted(*route(logits, bias, *routing))
    want = _sorted(*torch_route(logits, bias, *routing))
    return got, want


def _bias(method, num_experts, device, gen):
    if method != "noaux_tc":
        return None
    return (torch.randn(num_experts, generator=gen) * 0.3).to(device)


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("name,scoring,method,n_group,topk_group,top_k,norm,scale", ROUTINGS, ids=ROUTING_IDS)
def test_same_experts_and_weights_as_torch(device, name, scoring, method, n_group, topk_group, top_k, norm, scale,
                                           num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 8, generator=gen).to(device)
    bias = _bias(method, 8, device, gen)
    (w, ids), (want_w, want_ids) = _both(logits, bias, top_k, scoring, method, n_group, topk_group, norm, scale)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 64])
@pytest.mark.parametrize("name,E,scoring,method,n_group,topk_group,top_k,norm,scale", REAL, ids=[r[0] for r in REAL])
def test_real_routers(device, name, E, scoring, method, n_group, topk_group, top_k, norm, scale, num_tokens):
    """DeepSeek's sizes (E = 64, 160 in 8 groups, 256 in 8 groups): a float32 router's logits."""
    gen = torch.Generator().manual_seed(E)
    logits = torch.randn(num_tokens, E, generator=gen).to(device) * 2
    bias = _bias(method, E, device, gen)
    (w, ids), (want_w, want_ids) = _both(logits, bias, top_k, scoring, method, n_group, topk_group, norm, scale)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


def test_best_first_and_ties_to_the_lower_id(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 1.0, 0.0, 3.0]], device=device)
    w, ids = route(logits, None, 4, "softmax", "greedy", 1, 1, False, 1.0)
    assert ids.tolist() == [[1, 3, 7, 4]]
    assert w[0, 0] == w[0, 1] == w[0, 2] and w[0, 2] > w[0, 3]
    # every score equal: the first top_k experts, weights 1/E
    w, ids = route(torch.zeros(2, 8, device=device), None, 3, "softmax", "greedy", 1, 1, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(w, torch.full_like(w, 1 / 8))


def test_groups_are_chosen_before_experts(device):
    """group_limited_greedy: the two best groups by their best expert; the second best expert
    overall (in a dropped group) is not taken; noaux_tc ranks groups by their two best."""
    logits = torch.full((1, 8), -5.0, device=device)
    logits[0, 0], logits[0, 2], logits[0, 3], logits[0, 4], logits[0, 5] = 4.0, 3.5, 3.4, 2.0, 1.9
    # groups of two: {0,1} best 4.0, {2,3} best 3.5, {4,5} best 2.0, {6,7} best -5
    _, ids = route(logits, None, 3, "softmax", "group_limited_greedy", 4, 2, False, 1.0)
    assert sorted(ids[0].tolist()) == [0, 2, 3]
    _, ids = route(logits, None, 2, "softmax", "group_limited_greedy", 4, 1, False, 1.0)
    assert sorted(ids[0].tolist()) == [0, 1]  # one group kept: its weaker expert beats group {2,3}'s
    # noaux_tc by the sum of two: {2,3} (3.5 + 3.4) beats {0,1} (4.0 - 5.0)
    _, ids = route(logits, None, 2, "sigmoid", "noaux_tc", 4, 1, True, 1.0)
    assert sorted(ids[0].tolist()) == [2, 3]


def test_nan_logits_stay_in_range(device):
    logits = torch.full((3, 8), float("nan"), device=device)
    _, ids = route(logits, None, 3, "softmax", "greedy", 1, 1, False, 1.0)
    assert ids.min() >= 0 and ids.max() < 8


def test_no_tokens(device):
    w, ids = route(torch.zeros(0, 8, device=device), None, 2, "softmax", "greedy", 1, 1, False, 1.0)
    assert w.shape == ids.shape == (0, 2)
