"""v4_moe (sqrtsoftplus / hash routing, clamped SwiGLU experts) against a float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

import mlagraph  # noqa: F401  (registers the ops)

from tests import helpers
from tests.helpers import arg_error, assert_value_error

T, D, I, E, K = 5, 6, 4, 5, 2
LIMIT = 1.5  # small, so the clamp bites on these random weights


def _args(hashed: bool, scoring="sqrtsoftplus", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g)
    down = torch.randn(E, D, I, generator=g)
    bias = None if hashed else torch.rand(E, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K] if hashed else None
    return [hidden, logits, gate_up, down, bias, ids, K, scoring, 1.5, LIMIT]


def ref_moe(hidden, logits, gate_up, down, bias, ids, top_k, scoring, scale, limit):
    out = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        lg = logits[t].double()
        score = {"sqrtsoftplus": lambda x: torch.log1p(torch.exp(x)).sqrt(), "sigmoid": torch.sigmoid,
                 "softmax": lambda x: torch.softmax(x, 0)}[scoring](lg)
        chosen = ids[t].tolist() if ids is not None else sorted(range(E), key=lambda e: -float(score[e] + bias[e]))[:top_k]
        w = score[chosen] / score[chosen].sum() * scale
        for e, we in zip(chosen, w):
            h = hidden[t].double()
            gate = (gate_up[e, :I].double() @ h).clamp(max=limit)
            up = (gate_up[e, I:].double() @ h).clamp(-limit, limit)
            act = gate / (1 + torch.exp(-gate)) * up
            out[t] += we * (down[e].double() @ act)
    return out


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_matches_float64_loop(hashed, scoring):
    args = _args(hashed, scoring)
    got = torch.ops.mlagraph.v4_moe(*args)
    torch.testing.assert_close(got.double(), ref_moe(*args), atol=1e-5, rtol=1e-5)


def test_the_clamp_matters():
    """With a huge limit the answer changes: the test above would catch a missing clamp."""
    args = _args(False)
    unclamped = list(args)
    unclamped[-1] = 1e9
    assert (torch.ops.mlagraph.v4_moe(*args) - torch.ops.mlagraph.v4_moe(*unclamped)).abs().max() > 1e-2
    assert math.isfinite(float(torch.ops.mlagraph.v4_moe(*unclamped).sum()))


@pytest.mark.parametrize("hashed", [False, True])
def test_opcheck_and_no_host_sync(hashed):
    args = _args(hashed)
    helpers.opcheck(torch.ops.mlagraph.v4_moe, tuple(args))
    with helpers.NoHostSync() as mode:
        torch.ops.mlagraph.v4_moe(*args)
    assert "mlagraph::v4_moe" in mode.ops_seen


@pytest.mark.parametrize("index,arg,bad", [
    (0, "hidden", torch.zeros(T)),
    (1, "router_logits", torch.zeros(T, E, dtype=torch.float64)),
    (2, "gate_up_proj", torch.zeros(E, 2 * I + 1, D)),
    (3, "down_proj", torch.zeros(E, D, I + 1)),
    (4, "e_score_correction_bias", torch.zeros(E + 1)),
    (5, "hash_ids", torch.zeros(T, K, dtype=torch.int64)),  # both bias and hash ids
    (6, "top_k", E + 1),
    (7, "scoring_func", "relu"),
    (9, "swiglu_limit", 0.0),
])
def test_bad_inputs(index, arg, bad):
    args = _args(False)
    args[index] = bad
    assert_value_error(torch.ops.mlagraph.v4_moe, args, arg_error(arg))
