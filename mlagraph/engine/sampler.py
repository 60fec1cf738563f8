"""Choosing the next token from a request's logits."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[int, float]:
    """(token, its log-probability at temperature 1): argmax when temperature == 0, else a draw
    from softmax(logits / temperature) with ``generator``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if temperature == 0:
        tok = int(torch.argmax(logp))
    else:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])


# --- speculative decoding: drafts and their verification --------------------------------------
#
# Greedy requests (temperature 0) take the same path with one-hot distributions: a draft is
# accepted exactly when it is the target's argmax, and the token after the first rejection is
# the argmax, so speculation changes no greedy output.


def distributions(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V], temperature [B] (0: greedy) -> the distributions tokens are drawn from
    [B, S, V] float32: softmax(logits / t), or one-hot at the argmax for t == 0."""
    logits = logits.float()
    greedy = (temperature == 0)[:, None, None]
    t = torch.where(temperature == 0, 1.0, temperature.float())[:, None, None]
    p = torch.softmax(logits / t, dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(p.dtype)
    return torch.where(greedy, one_hot, p)


def draft(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens from the draft model's logits [B, V]: (tokens [B] int64, the distribution
    each was drawn from [B, V], which verification needs)."""
    q = distributions(logits[:, None], temperature)[:, 0]
    return torch.multinomial(q, 1, generator=generator)[:, 0], q


def _accept(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """A draft d drawn from q is kept with probability min(1, p(d) / q(d))."""
    return u * q_d < p_d


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection the token comes from max(p - q, 0), normalised: with the accepted
    drafts this makes every emitted token distributed as p (Leviathan et al., 2023). Where
    p == q nothing is ever rejected; p stands in so the row stays a distribution."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
           temperature: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: which of k drafts per request to keep, and the token after them.

    Args:
        target_logits: [B, k + 1, V] the target's logits at the request's new token and at
            each draft (row i predicts the token after draft i).
        drafts: [B, k] int64; draft_probs: [B, k, V] the distributions they were drawn from.
        temperature: [B] (0: greedy).
    Returns:
        accepted [B] int64 (drafts kept, 0..k) and tokens [B, k + 1] int64: request b emits
        ``tokens[b, : accepted[b] + 1]`` (its kept drafts, then one token from the target).
    """
    B, S, V = target_logits.shape
    k = S - 1
    if drafts.shape != (B, k) or draft_probs.shape != (B, k, V) or temperature.shape != (B,):
        raise ValueError(f"verify: expected drafts [{B}, {k}], draft_probs [{B}, {k}, {V}] and temperature [{B}] "
                         f"for target_logits {list(target_logits.shape)}, got {list(drafts.shape)}, "
                         f"{list(draft_probs.shape)}, {list(temperature.shape)}")
    p = distributions(target_logits, temperature)
    d = drafts[..., None]
    u = torch.rand(B, k, generator=generator, device=p.device)
    keep = _accept(u, p[:, :k].gather(-1, d)[..., 0], draft_probs.float().gather(-1, d)[..., 0])
    accepted = keep.long().cumprod(-1).sum(-1)  # drafts before the first rejection
    at = accepted[:, None, None].expand(B, 1, V)
    q = torch.cat([draft_probs.float(), p.new_zeros(B, 1, V)], dim=1)  # after k kept drafts: p itself
    extra = torch.multinomial(_residual(p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]), 1, generator=generator)
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1).scatter(1, accepted[:, None], extra)
    return accepted, tokens
