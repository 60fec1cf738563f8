"""Metadata a kernel library makes once per step, shared by every layer (the plan/run split).

FlashInfer's MLA and ragged-prefill wrappers need a host-side ``plan()`` from the batch's
lengths and pages before they run; FlashMLA's decode needs its tile-scheduler metadata, made
on the device from ``seq_lens``. Both are pure functions of the step's metadata tensors, the
same for every layer, so they are made once per step:

- The engine runs each forward inside :func:`step`, handing over the HOST values of the
  batch's metadata tensors (``mirrors``: device tensor -> its CPU copy, which the batch builder
  has anyway). An op reads them with :func:`host_value` instead of copying to the host (a
  sync, and impossible while a CUDA graph is being captured).
- :meth:`Step.plan` keeps one plan per key for the step: the first layer makes it, the others
  reuse it. A plan made for a captured graph stays with the graph: before each replay the
  engine calls :meth:`Step.refresh` with the new step's mirrors, and each plan re-plans into
  the same buffers the graph reads (FlashInfer's ``use_cuda_graph`` wrappers).

Outside a step (an op called directly, a benchmark) :func:`host_value` copies the tensor to
the host, and :meth:`Step.plan` makes a fresh plan per call: the result is the same, only
slower. While a CUDA graph is being captured outside a step, that copy raises, naming the op.

A plan never changes what an op computes: it caches a function of the op's own inputs.
Nothing here chooses a code path (docs/design.md rule 1).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterator, Mapping

import torch


def tensor_key(t: torch.Tensor) -> tuple:
    """Identity of a device tensor's data as an op sees it: storage address, offset, shape,
    strides (a view of the same buffer with other bounds is another tensor)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class Plan:
    """One plan: ``make(step) -> value``; ``refresh(value, step)`` re-plans it in place for a
    new step's mirrors (None: nothing to redo, e.g. device-side metadata a graph recomputes)."""

    def __init__(self, value: object, refresh: Callable[[object, "Step"], None] | None):
        self.value, self._refresh = value, refresh

    def refresh(self, step: "Step") -> None:
        if self._refresh is not None:
            self._refresh(self.value, step)


class Step:
    """The host facts of one step and the plans made from them.

    Args:
        mirrors: device metadata tensor -> a CPU tensor with its values (same shape).
    """

    def __init__(self, mirrors: Mapping[torch.Tensor, torch.Tensor] | None = None):
        self._mirrors = {tensor_key(d): h for d, h in (mirrors or {}).items()}
        self._plans: dict[Hashable, Plan] = {}

    def mirror(self, t: torch.Tensor) -> torch.Tensor | None:
        return self._mirrors.get(tensor_key(t))

    def plan(self, key: Hashable, make: Callable[["Step"], object],
             refresh: Callable[[object, "Step"], None] | None = None) -> object:
        """The step's plan for ``key``, made by ``make(self)`` on first use."""
        if key not in self._plans:
            self._plans[key] = Plan(make(self), refresh)
        return self._plans[key].value

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def refresh(self, mirrors: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """New host values for the same device tensors (a graph replay): re-plans every plan."""
        self._mirrors = {tensor_key(d): h for d, h in mirrors.items()}
        for p in self._plans.values():
            p.refresh(self)


_CURRENT: contextvars.ContextVar[Step | None] = contextvars.ContextVar("mlagraph_step", default=None)


def current() -> Step | None:
    return _CURRENT.get()


@contextlib.contextmanager
def step(mirrors: Mapping[torch.Tensor, torch.Tensor] | Step | None = None) -> Iterator[Step]:
    """Runs the body as one step: ops share the plans made in it. Pass a :class:`Step` to
    reuse one (a captured graph's)."""
    s = mirrors if isinstance(mirrors, Step) else Step(mirrors)
    token = _CURRENT.set(s)
    try:
        yield s
    finally:
        _CURRENT.reset(token)


def host_value(op: str, t: torch.Tensor, s: Step | None = None) -> torch.Tensor:
    """The values of metadata tensor ``t`` on the host: the step's mirror if it has one, else
    a copy (a host sync: refused while a CUDA graph is being captured)."""
    s = s if s is not None else current()
    found = s.mirror(t) if s is not None else None
    if found is not None:
        return found
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: needs the host values of a metadata tensor of shape {list(t.shape)} while a CUDA graph is "
            "being captured, and the step has no mirror of it: run the capture inside "
            "mlagraph.ops.host_plan.step(mirrors) with the batch's host metadata")
    return t.cpu()


def plan(key: Hashable, make: Callable[[Step], object], refresh: Callable[[object, Step], None] | None = None):
    """:meth:`Step.plan` on the current step, or a fresh plan (from a throwaway step) outside one."""
    s = current()
    if s is None:
        return make(Step())
    return s.plan(key, make, refresh)
