"""Op twins: a backend's own op for a generic op, with the generic op's schema.

A backend implements generic op ``mlagraph::<op>`` as ``<namespace>::<op>``: same schema (so
the model and the graph passes can swap one for the other), same argument check (so the same
errors, eagerly and under fake tensors) and same fake kernel; only the implementation differs.
The implementation module is imported on the first call, so registering a backend costs nothing
and never imports its kernel library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch


def define_twin(namespace: str, generic: str, check: Callable, fake: Callable, module: str) -> None:
    """Registers ``namespace::generic``: ``check(*args)``, then ``module.<generic>(*args)``."""
    schema = getattr(torch.ops.mlagraph, generic).default._schema
    mutates = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    signature = str(schema)[len(f"mlagraph::{generic}"):]  # "(Tensor q_pe, ...) -> (...)"

    def impl(*args):
        check(*args)
        return getattr(importlib.import_module(module), generic)(*args)

    impl.__name__ = generic
    op = torch.library.custom_op(f"{namespace}::{generic}", impl, mutates_args=mutates, schema=signature)
    op.register_fake(fake)
