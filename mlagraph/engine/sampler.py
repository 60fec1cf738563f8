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
