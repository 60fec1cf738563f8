"""How mlagraph defines its generic ops: ``torch.library.custom_op``, with each op's Python body
kept by name.

The body is the reference implementation in plain PyTorch. Tests re-enter it under a dispatch
mode to look inside the op (the host-sync detector), and benchmarks hand it to torch.compile
(the custom op itself is opaque to Inductor); torch keeps the function only under a private
attribute, so we keep our own record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_BODIES: dict[str, Callable] = {}


def custom_op(qualname: str, *, mutates_args: Sequence[str]):
    """``@torch.library.custom_op(qualname, mutates_args=...)`` that also records the body."""

    def define(fn: Callable):
        _BODIES[qualname] = fn
        return torch.library.custom_op(qualname, fn, mutates_args=tuple(mutates_args))

    return define


def op_body(qualname: str) -> Callable:
    """The plain-PyTorch body of generic op ``qualname`` ("mlagraph::rope", ...)."""
    if qualname not in _BODIES:
        raise ValueError(f"op_body: unknown op {qualname!r}; known: {', '.join(sorted(_BODIES))}")
    return _BODIES[qualname]


def op_bodies() -> dict[str, Callable]:
    """qualified name -> body, for every generic op."""
    return dict(_BODIES)


def dense_empty(like: torch.Tensor, shape: Sequence, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised contiguous tensor for a fake kernel's output, its strides written out.

    ``new_empty``'s traced strides read ``max(1, size)`` products (a size that may be 0), which
    Inductor cannot prove contiguous; a later view of the output (the model's [B, s_q] -> [T]
    reshape of an attention output) then asks whether a size is 1, a guard that makes a
    one-request step compile again."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return like.new_empty_strided(tuple(shape), tuple(reversed(strides)), dtype=dtype or like.dtype)
