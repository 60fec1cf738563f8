"""Speculative sampling keeps the target distribution (mlagraph.engine.sampler.verify).

One batched call verifies N independent requests on a 5-token vocabulary, k = 2 drafts drawn
from a draft distribution q unlike the target p. Every emitted token must be distributed as
p: the first always, the second among the requests whose first draft was kept; and the
first draft is kept with probability sum(min(p, q)).

Thresholds: each frequency f of a probability pi from n draws has standard deviation
s = sqrt(pi(1 - pi) / n); the test allows 6 s. A correct sampler exceeds that with
probability < 1e-8 per check (Chernoff), whatever the seed, so it cannot flake; the wrong
samplers below move some frequency by >= 0.05, which is > 20 s at N = 200 000, so they fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlagraph.engine import sampler

N, K = 200_000, 2
P = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10], [0.30, 0.05, 0.05, 0.30, 0.30], [0.2] * 5])  # target, per position
Q = torch.tensor([[0.40, 0.10, 0.10, 0.30, 0.10], [0.10, 0.50, 0.20, 0.10, 0.10]])  # draft, per position
SIGMAS = 6.0


def _worst_z(seed: int = 0) -> float:
    """The largest |f - p| / s over the checks above (temperature 1)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=g) for i in range(K)], 1)
    accepted, tokens = sampler.verify(P.log().expand(N, K + 1, 5), drafts, Q.expand(N, K, 5),
                                      torch.ones(N), g)
    checks = []
    first = torch.bincount(tokens[:, 0], minlength=5).double() / N
    checks += [(f, p, N) for f, p in zip(first.tolist(), P[0].tolist())]
    kept = accepted >= 1
    n1 = int(kept.sum())
    second = torch.bincount(tokens[kept, 1], minlength=5).double() / n1
    checks += [(f, p, n1) for f, p in zip(second.tolist(), P[1].tolist())]
    checks.append((n1 / N, float(torch.minimum(P[0], Q[0]).sum()), N))
    return max(abs(f - p) / math.sqrt(p * (1 - p) / n) for f, p, n in checks)


def test_verify_keeps_the_target_distribution():
    assert _worst_z() < SIGMAS


@pytest.mark.parametrize("bug", ["accept_every_draft", "accept_by_p_alone", "resample_from_target"])
def test_wrong_samplers_fail_the_same_check(monkeypatch, bug):
    """The check has teeth: plausible sampler bugs are far outside the threshold."""
    if bug == "accept_every_draft":
        monkeypatch.setattr(sampler, "_accept", lambda u, p_d, q_d: torch.ones_like(u, dtype=torch.bool))
    elif bug == "accept_by_p_alone":  # forgets to divide by q(d)
        monkeypatch.setattr(sampler, "_accept", lambda u, p_d, q_d: u < p_d)
    else:  # after a rejection, draws from p instead of max(p - q, 0)
        monkeypatch.setattr(sampler, "_residual", lambda p, q: p)
    assert _worst_z() > 3 * SIGMAS


def test_greedy_verify_keeps_argmax_prefix():
    """temperature 0: drafts are kept while they are the target's argmax; then the argmax."""
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]] * 3)
    drafts = torch.tensor([[1, 0], [1, 2], [2, 0]])
    probs = torch.nn.functional.one_hot(drafts, 3).float()
    accepted, tokens = sampler.verify(logits, drafts, probs, torch.zeros(3), torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 1, 0]
    assert [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())] == [[1, 0, 2], [1, 0], [1]]


def test_verify_checks_shapes():
    with pytest.raises(ValueError, match=r"verify: expected drafts \[2, 2\], draft_probs \[2, 2, 3\] and temperature \[2\]"):
        sampler.verify(torch.zeros(2, 3, 3), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 2, 3), torch.zeros(2),
                       torch.Generator())
