"""torch.compile entry points: ``mlagraph.compile`` and the dynamo backends ``mlagraph`` and
``mlagraph_eager`` (registered through the ``torch_dynamo_backends`` entry point).

    compiled = mlagraph.compile(model, dynamic=True)                 # Inductor + our passes
    compiled = torch.compile(model, backend="mlagraph")             # the same, by name
    compiled = torch.compile(model, backend="mlagraph_eager")       # passes on the AOT graph,
                                                                    # run eagerly (debugging)

Both backends run :class:`~mlagraph.passes.manager.MLAPassManager` for the model's attention
backend. ``mlagraph.compile`` reads it from the model (``model.backend``); by name, pass
``options={"attention_backend": "triton"}``, or it is the one backend whose private ops
appear in the graph (``reference`` when none do).

``mlagraph.compile`` returns a :class:`CompiledStep`, which owns its graphs: one compiled
function per batch-plan variant, each with a code object of its own. Dynamo keeps its cache
and its recompile budget per code object, so a step compiled this way never shares them with
another model, engine or variant in the process (``torch.compile(model)`` would: every
instance of a class shares its ``forward`` and the limit of 8 graphs that comes with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ._compat import symbolic_sizes
from .ops import backends
from .passes.graph_utils import op_name
from .passes.manager import MLAPassManager
from .regional import RegionalStep, supports_regions

_PASS_OPTIONS = ("attention_backend", "strict", "lint", "passes")


def _split_options(options: dict | None) -> tuple[dict, dict]:
    options = dict(options or {})
    ours = {k: options.pop(k) for k in _PASS_OPTIONS if k in options}
    return ours, options


def _attention_backend(gm: torch.fx.GraphModule, name: str | None) -> backends.Backend:
    if name is not None:
        return backends.get(name)
    present = {op_name(n) for n in gm.graph.nodes}
    private = set().union(*(b.owned_ops() for b in backends.registered())) & present
    if not private:
        return backends.get("reference")
    # The backend that maps every private op present (its own, or a declared fallback: an
    # aiter graph holds triton's RoPE) and owns at least one of them (a triton graph is
    # triton's, though aiter maps all of its ops too).
    fits = [b.name for b in backends.registered()
            if private <= set(b.op_names.values()) and b.owned_ops() & private]
    if len(fits) != 1:
        owners = [b.name for b in backends.registered() if b.owned_ops() & private]
        raise ValueError(f"mlagraph backend: the graph mixes ops private to backends {owners}")
    return backends.get(fits[0])


def _pass_manager(gm, ours: dict) -> MLAPassManager:
    backend = _attention_backend(gm, ours.get("attention_backend"))
    return MLAPassManager(
        backend, strict=ours.get("strict", False), lint=ours.get("lint", True), passes=ours.get("passes")
    )


def mlagraph_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options: dict | None = None):
    """Dynamo backend ``"mlagraph"``: Inductor with mlagraph's post-grad pass manager."""
    from torch._inductor.compile_fx import compile_fx

    ours, inductor_options = _split_options(options)
    config = dict(inductor_options)
    if mode is not None:
        config.update(torch._inductor.list_mode_options(mode))
    config["post_grad_custom_post_pass"] = _pass_manager(gm, ours)
    return compile_fx(gm, example_inputs, config_patches=config)


def mlagraph_eager_backend(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options: dict | None = None):
    """Dynamo backend ``"mlagraph_eager"``: the same passes on the AOT-autograd graph, run eagerly."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ours, _ = _split_options(options)
    manager = _pass_manager(gm, ours)

    def fw_compiler(fw: torch.fx.GraphModule, inputs):
        manager(fw.graph)
        fw.recompile()
        return make_boxed_func(fw.forward)

    return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)(gm, example_inputs)


def compile(model_or_fn, *, backend: str = "mlagraph", strict: bool = False, lint: bool = True, passes=None,
            attention_backend: str | None = None, regional: bool = True,
            **torch_compile_kwargs: Any) -> CompiledStep | RegionalStep:
    """``torch.compile`` with mlagraph's passes for the model's attention backend.

    Args:
        model_or_fn: a DeepseekForCausalLM (its ``.backend`` names the attention backend) or any
            callable (then ``attention_backend`` or the graph's ops decide).
        backend: "mlagraph" (Inductor) or "mlagraph_eager" (AOT graph run eagerly).
        regional: for a DeepSeek model, compile each kind of layer block once and run every
            layer of that kind through its graph (:class:`~mlagraph.regional.RegionalStep`);
            False compiles the whole step as one graph per variant (:class:`CompiledStep`).
            Other callables are always compiled whole.
        strict: a requested fusion that matches nothing raises instead of warning.
        lint: run the graph lints (rope once, write once, backend ops).
        passes: rewrite passes to run (default all; ``()`` for none: lints only).
        **torch_compile_kwargs: passed to ``torch.compile`` (fullgraph, dynamic, mode, options).
    """
    if backend not in ("mlagraph", "mlagraph_eager"):
        raise ValueError(f"mlagraph.compile: backend: expected 'mlagraph' or 'mlagraph_eager', got {backend!r}")
    if attention_backend is None and hasattr(model_or_fn, "backend"):
        attention_backend = model_or_fn.backend.name
    options = dict(torch_compile_kwargs.pop("options", None) or {})
    options.update(strict=strict, lint=lint, passes=passes, attention_backend=attention_backend)
    fn = mlagraph_backend if backend == "mlagraph" else mlagraph_eager_backend
    mode = torch_compile_kwargs.pop("mode", None)

    def compiler(gm, example_inputs):
        return fn(gm, example_inputs, mode=mode, options=options)

    if regional and supports_regions(model_or_fn):
        return RegionalStep(model_or_fn, compiler, torch_compile_kwargs)
    return CompiledStep(model_or_fn, compiler, torch_compile_kwargs)


def variant_of(args: tuple) -> Hashable:
    """What selects a step's graph: a Batch's host-side variant (plan, forward method, ...), or
    None for calls that are not engine steps."""
    first = args[0] if args else None
    return getattr(first, "variant", None)


class CompiledStep:
    """A callable compiled per batch-plan variant (see the module docstring).

    ``step(batch, caches)`` runs the graph of ``batch.variant``, compiling it on first use;
    every other call (args that are not a Batch) shares one compiled function. Dynamic
    dimensions are traced without duck shaping, a size of 1 included (:func:`mlagraph._compat.symbolic_sizes`).

    Attributes:
        fn: the model or function it compiles.
        graphs: variant -> number of graphs dynamo compiled for it (1 each, when nothing
            recompiles).
        compile_seconds: wall time of the calls that compiled a variant (each one run included).
    """

    def __init__(self, fn: Callable, compiler: Callable, torch_compile_kwargs: dict):
        self.fn = fn
        self.graphs: dict[Hashable, int] = {}
        self.compile_seconds = 0.0
        self._compiler, self._kwargs = compiler, torch_compile_kwargs
        self._compiled: dict[Hashable, Callable] = {}

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far, over all variants."""
        return sum(self.graphs.values())

    def __call__(self, *args, **kwargs):
        key = variant_of(args)
        compiled = self._compiled.get(key)
        if compiled is not None:
            with symbolic_sizes():
                return compiled(*args, **kwargs)
        start = time.perf_counter()
        compiled = self._compiled[key] = self._compile(key)
        with symbolic_sizes():
            out = compiled(*args, **kwargs)
        self.compile_seconds += time.perf_counter() - start
        return out

    def _compile(self, key: Hashable) -> Callable:
        self.graphs[key] = 0

        def counting_compiler(gm, example_inputs):
            compiled = self._compiler(gm, example_inputs)
            # counted once compiled: dynamo may abandon a trace and restart it (it raises
            # through the backend), which is not a graph of ours
            self.graphs[key] += 1
            return compiled

        return torch.compile(_own_code(self.fn), backend=counting_compiler, **self._kwargs)


def _own_code(fn: Callable) -> Callable:
    """``fn`` called through a function whose code object is new: dynamo's cache and recompile
    budget are per code object, so this one shares them with nothing (``code.replace()``
    always builds a new code object)."""

    def step(*args, **kwargs):
        return fn(*args, **kwargs)

    step.__code__ = step.__code__.replace()
    return step
