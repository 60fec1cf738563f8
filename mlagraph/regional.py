"""Regional compilation: one graph per kind of layer block, shared by every layer of that kind.

``mlagraph.compile(model)`` returns a :class:`RegionalStep` for a DeepSeek model. It runs the
step as the model's own ``forward`` does, part by part, each part a compiled *region*:

    embed(input_ids [T]) -> h                          one graph
    for each layer i:
        h = layer.attention_block(h, batch, ...)       one graph per (attention kind, batch variant)
        h = layer.mlp_block(h, ...)                    one graph per MLP kind (dense, MoE; V4: hash)
    head(h, logits_indices [N]) -> logits [N, V]       one graph (``with_head``: another head,
                                                       the same embed / layer graphs)

A region is compiled with the layer module as an *argument*: its parameters and buffers are
graph inputs, not constants, so the graph compiled at the first layer of a kind runs every
other layer of that kind (dynamo guards on their shapes and dtypes, which agree, never on which
module it is). Compile time therefore stops growing with depth. The attention block is the only
part that reads the batch plan; the MLP, embedding and head are compiled once for all variants.
A one-token batch (a CUDA graph's bucket 1) runs the same graphs: sizes are traced
size-oblivious (``_compat.symbolic_sizes``), so dynamo does not specialise a dimension seen as 1.

Every guarantee of the whole-model step holds per region: the same backend (fusion passes,
concat elimination, lints) compiles each, fullgraph, dynamic sizes, no duck shapes, a code
object per region (dynamo's cache and recompile budget are per code object, so nothing is
shared with another step or engine). The first call of a batch variant files one
:class:`~mlagraph.passes.CompileReport` for the step: every layer's records (copied from its
kinds' graphs), and the text of each region it ran, once per region; none when every new
region came from Inductor's FX graph cache (as for a whole-model step served from it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from ._compat import symbolic_sizes, specialized_floats
from .passes import manager
from .passes.manager import CompileReport, PassRecord


def supports_regions(model) -> bool:
    """Whether ``model`` exposes the parts a regional step runs (the DeepSeek models do)."""
    parts = ("embed", "head", "attention_args", "mlp_args")
    return all(callable(getattr(model, p, None)) for p in parts) and hasattr(getattr(model, "model", None), "layers")


class Region:
    """One compiled part of the step: ``module.<method>(*args)`` through a code object of its own.

    Attributes:
        label: what it runs, for reports ("attention (mla)").
        graphs: graphs dynamo compiled for it (1, when nothing recompiles).
        report: its compile's report (None until compiled, or when Inductor's FX graph cache
            served the graph: the passes ran when it was first compiled, not here).
        seconds: wall time of its calls in batch variants' first steps, its compiling call
            (trace, passes, codegen, and one run) among them; timed by ``RegionalStep``.
    """

    def __init__(self, label: str, method: str, compiler: Callable, torch_compile_kwargs: dict):
        self.label, self.graphs, self.report, self.seconds = label, 0, None, 0.0

        def counting_compiler(gm, example_inputs):
            compiled = compiler(gm, example_inputs)
            self.graphs += 1  # counted once compiled: dynamo may abandon a trace and restart it
            return compiled

        self._fn = torch.compile(_calls(method), backend=counting_compiler, **torch_compile_kwargs)

    @property
    def num_graphs(self) -> int:
        return self.graphs

    @property
    def compile_seconds(self) -> float:
        return self.seconds

    def __call__(self, module, *args):
        if self.graphs:
            return self._fn(module, *args)
        with manager.collecting() as reports, specialized_floats():  # one trace, not two
            out = self._fn(module, *args)
        if reports:
            self.report = reports[-1]
        return out


def _calls(method: str) -> Callable:
    """``f(module, *args) = module.<method>(*args)``, with a new code object (``replace()``
    always builds one), so its dynamo cache and recompile budget belong to one region."""

    def region(module, *args):
        return getattr(module, method)(*args)

    region.__code__ = region.__code__.replace()
    return region


class RegionalStep:
    """``step(batch, caches) -> logits``: the model's step run region by region (module docstring).

    Attributes:
        fn: the model.
        regions: key -> :class:`Region`; keys are ("embed",), ("attention", kind, batch
            variant), ("mlp", kind), ("head",) (("head", method) for a :meth:`with_head` step's
            head). Shared with the steps :meth:`with_head` derives.
        head: the model method that ends the step (``head``: logits).
        variants: the batch variants this step has run.
    """

    def __init__(self, model, compiler: Callable, torch_compile_kwargs: dict, head: str = "head",
                 regions: dict[Hashable, Region] | None = None):
        if not supports_regions(model):
            raise ValueError(f"mlagraph.compile: regional=True: expected a DeepSeek model (embed, layers, head), "
                             f"got {type(model).__name__}; pass regional=False to compile it whole")
        if not callable(getattr(model, head, None)):
            raise ValueError(f"RegionalStep: head: expected a method of {type(model).__name__}, got {head!r}")
        self.fn = model
        self.head = head
        self.regions: dict[Hashable, Region] = {} if regions is None else regions
        self.variants: set[Hashable] = set()
        self._compiler, self._kwargs = compiler, torch_compile_kwargs

    def with_head(self, head: str) -> RegionalStep:
        """The same step ending in ``model.<head>(h, logits_indices)`` instead of ``head``, sharing
        this step's regions: its embedding, attention and MLP graphs are not compiled again, only
        the new head is (speculative decoding's target and hidden-state steps)."""
        return RegionalStep(self.fn, self._compiler, self._kwargs, head=head, regions=self.regions)

    @property
    def graphs(self) -> dict[Hashable, int]:
        """Region key -> graphs compiled for it."""
        return {key: r.graphs for key, r in self.regions.items()}

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far, over all regions: independent of depth."""
        return sum(r.graphs for r in self.regions.values())

    @property
    def compile_seconds(self) -> float:
        """Wall time of each batch variant's first step, as a whole-model step counts it: the
        calls that compiled a region, and the runs of regions compiled before (first launches
        at new sizes happen there; counted elsewhere they would land in CUDA-graph capture time)."""
        return sum(r.seconds for r in self.regions.values())

    def _region(self, key: tuple, method: str) -> Region:
        region = self.regions.get(key)
        if region is None:
            label = key[0] if len(key) == 1 else f"{key[0]} ({key[1]})"
            region = self.regions[key] = Region(label, method, self._compiler, self._kwargs)
        return region

    def __call__(self, batch, caches) -> torch.Tensor:
        model, variant = self.fn, batch.variant
        ran: list[tuple[Region, int | None]] | None = None if variant in self.variants else []
        known = set() if ran is None else {id(r.report) for r in self.regions.values()}

        def run(key, method, module, args, layer=None):
            region = self._region(key, method)
            if ran is None:
                return region(module, *args)
            ran.append((region, layer))
            start = time.perf_counter()  # a new variant's first step: compiling, or a first run at its sizes
            out = region(module, *args)
            region.seconds += time.perf_counter() - start
            return out

        with symbolic_sizes():
            h = run(("embed",), "embed", model, (batch.input_ids,))
            mlp_args = model.mlp_args(batch)
            for i, layer in enumerate(model.model.layers):
                h = run(("attention", layer.attention_kind, variant), "attention_block", layer,
                        (h, batch, *model.attention_args(caches, i)), i)
                h = run(("mlp", layer.mlp_kind), "mlp_block", layer, (h, *mlp_args), i)
            head_key = ("head",) if self.head == "head" else ("head", self.head)
            logits = run(head_key, self.head, model, (h, batch.logits_indices))
        if ran is not None:
            self.variants.add(variant)
            # Filed when some region ran the passes now; a step whose new regions all came
            # from Inductor's FX graph cache files none, as a whole-model step would.
            if any(r.report is not None and id(r.report) not in known for r, _ in ran):
                manager.add_report(_step_report(model.backend.name, ran))
        return logits


def _step_report(backend: str, ran: list[tuple[Region, int | None]]) -> CompileReport:
    """One report for a step's first call: each layer's records from its kinds' graphs, and the
    text of every region it ran, once each, headed by the layers it serves."""
    layers: dict[Region, list[int]] = {}
    for region, layer in ran:
        layers.setdefault(region, [])
        if layer is not None:
            layers[region].append(layer)
    records, before, after, seconds = [], [], [], 0.0
    for region, served in layers.items():
        where = f": layer{'s' if len(served) > 1 else ''} {_spans(served)}" if served else ""
        head = f"# {region.label}{where}"
        rep = region.report
        if rep is None:  # served by Inductor's FX graph cache: its passes ran at its first compile
            before.append(f"{head}\n(graph from the FX graph cache)")
            after.append(before[-1])
            continue
        before.append(f"{head}\n{rep.before}")
        after.append(f"{head}\n{rep.after}")
        seconds += rep.seconds
        for r in rep.records:  # a region's nodes belong to no layer (layer None): to each it serves
            for layer in (served if r.layer is None and served else [r.layer]):
                records.append(PassRecord(r.graph, r.pass_name, layer, r.count))
    order = list(manager.PASSES)
    records.sort(key=lambda r: (order.index(r.pass_name), r.layer is None, r.layer or 0))
    return CompileReport(manager.new_graph_name(backend), backend, records, "\n".join(before), "\n".join(after),
                         seconds)


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(spans)


def compiled_units(steps) -> list:
    """The separately compiled things of ``steps`` (CompiledSteps, RegionalSteps), each once:
    a RegionalStep counts as its regions, which steps made by ``with_head`` share. Each has
    ``num_graphs`` and ``compile_seconds``."""
    units: dict[int, object] = {}
    for step in steps:
        for unit in (step.regions.values() if isinstance(step, RegionalStep) else (step,)):
            units.setdefault(id(unit), unit)
    return list(units.values())
