"""The pass manager: an Inductor ``CustomGraphPass`` running mlagraph's passes for one backend.

Its ``uuid()`` hashes the pass sources, the backend's name and capability table, and every
setting the passes read, so Inductor's FX graph cache can never hand one backend's compiled
graph to another (the seed bug of docs/design.md rule 1 in cache form).

Every run appends a :class:`CompileReport` to a process-wide list: ``reports()`` returns the
records of all compiles (newest last), ``last_report()`` those of the newest one. A requested
fusion that matches in no layer warns, and raises with ``strict=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import os
import time
import warnings
from collections.abc import Iterator

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..ops.backends import Backend
from . import fusion, fusion_v4, lints
from .graph_utils import is_any_op, names_of
from .render import render

PASSES = {
    "fuse_rope_concat_cache": fusion.fuse_rope_concat_cache,
    "eliminate_concat": fusion.eliminate_concat,
    "fuse_v4_rope_window_write": fusion_v4.fuse_v4_rope_window_write,
}


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One pass's matches in one layer of one compiled graph."""

    graph: str  # which compiled graph: "<backend>#<n>"
    pass_name: str
    layer: int | None
    count: int


@dataclasses.dataclass
class CompileReport:
    graph: str
    backend: str
    records: list[PassRecord]
    before: str  # canonical text (mlagraph.passes.render) before the passes
    after: str  # ... and after
    seconds: float = 0.0  # time spent in the passes, lints and rendering


_REPORTS: list[CompileReport] = []
_COUNTER = itertools.count()
# Where a compile's report goes: the process list, or the innermost collecting() list.
_SINKS: list[list[CompileReport]] = [_REPORTS]


@contextlib.contextmanager
def collecting() -> Iterator[list[CompileReport]]:
    """Reports of the compiles inside go to the yielded list instead of the process list (a
    regional step gathers its regions' reports into one per step, :func:`add_report`)."""
    sink: list[CompileReport] = []
    _SINKS.append(sink)
    try:
        yield sink
    finally:
        # by identity: list.remove compares by value, and an empty sink equals an empty
        # process list, which it would remove instead (every later report then went nowhere)
        del _SINKS[next(i for i in range(len(_SINKS) - 1, -1, -1) if _SINKS[i] is sink)]


def add_report(report: CompileReport) -> None:
    """Appends a report made outside a pass manager (a regional step's) to the process list."""
    _REPORTS.append(report)


def new_graph_name(backend: str) -> str:
    return f"{backend}#{next(_COUNTER)}"


def reports() -> list[PassRecord]:
    """Records of every compile in this process, newest last."""
    return [r for rep in _REPORTS for r in rep.records]


def last_report() -> list[PassRecord]:
    """Records of the newest compile (empty if nothing was compiled)."""
    return list(_REPORTS[-1].records) if _REPORTS else []


def last_compile() -> CompileReport | None:
    """The newest compile's full report, with its graph before and after the passes."""
    return _REPORTS[-1] if _REPORTS else None


def clear_reports() -> None:
    _REPORTS.clear()


class FusionNotApplied(RuntimeError):
    """strict=True: a fusion the backend asks for matched in no layer."""


class MLAPassManager(CustomGraphPass):
    """Runs the fusions the backend's capability table asks for, then the lints.

    Args:
        backend: the model's attention backend.
        strict: raise (instead of warn) when a requested fusion matches nothing; lints on.
        lint: run the lints (on in tests and with strict).
        passes: names of the rewrite passes to run (default: all); ``()`` runs lints only.
    """

    def __init__(self, backend: Backend, *, strict: bool = False, lint: bool = True, passes=None):
        self.backend = backend
        self.strict = strict
        self.lint = lint or strict
        self.passes = tuple(PASSES) if passes is None else tuple(passes)
        unknown = [p for p in self.passes if p not in PASSES]
        if unknown:
            raise ValueError(f"passes: unknown pass names {unknown}; known: {list(PASSES)}")

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        name = new_graph_name(self.backend.name)
        before = render(graph)
        records = []
        for pass_name in self.passes:
            counts = PASSES[pass_name](graph, self.backend)
            records += [PassRecord(name, pass_name, layer, n) for layer, n in sorted(counts.items(), key=_key)]
            if self._requested(pass_name, graph) and not counts:
                msg = f"mlagraph: requested fusion {pass_name!r} matched in no layer of graph {name}"
                if self.strict:
                    raise FusionNotApplied(msg)
                warnings.warn(msg, stacklevel=2)
        graph.lint()
        if self.lint:
            for lint in lints.LINTS.values():
                lint(graph, self.backend)
        after = render(graph)
        _SINKS[-1].append(CompileReport(name, self.backend.name, records, before, after, time.perf_counter() - start))

    def _requested(self, pass_name: str, graph: fx.Graph) -> bool:
        """A fusion is requested when the backend has it and the graph has the sequence's start
        (a latent cache write), unless the only writes are ones the backend's fused op cannot
        serve because their K is read elsewhere and it returns none (aiter's MHA prefill)."""
        caps = self.backend.capabilities
        writes = names_of(self.backend, "latent_cache_write")
        has_write = any(is_any_op(n, writes) and not fusion.needs_missing_k(n, self.backend) for n in graph.nodes)
        if pass_name == "fuse_rope_concat_cache":
            return caps.fused_rope_cache and has_write
        if pass_name == "fuse_v4_rope_window_write":  # DeepSeek-V4: a window cache write
            window_writes = names_of(self.backend, "swa_cache_write")
            return caps.fused_rope_window_write and any(is_any_op(n, window_writes) for n in graph.nodes)
        return False  # eliminate_concat applies only to decode graphs; absence is not an error

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        here = os.path.dirname(__file__)
        for f in sorted(os.listdir(here)):
            if f.endswith(".py"):
                with open(os.path.join(here, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
        h.update(repr((self.backend.name, self.backend.capabilities, sorted(self.backend.op_names.items()))).encode())
        h.update(repr((self.strict, self.lint, self.passes)).encode())
        return h.hexdigest().encode()


def _key(item):
    layer, _ = item
    return (layer is None, layer if layer is not None else 0)
