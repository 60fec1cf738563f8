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
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import backends
from .passes.graph_utils import op_name
from .passes.manager import MLAPassManager

_PASS_OPTIONS = ("attention_backend", "strict", "lint", "passes")


def _split_options(options: dict | None) -> tuple[dict, dict]:
    options = dict(options or {})
    ours = {k: options.pop(k) for k in _PASS_OPTIONS if k in options}
    return ours, options


def _attention_backend(gm: torch.fx.GraphModule, name: str | None) -> backends.Backend:
    if name is not None:
        return backends.get(name)
    present = {op_name(n) for n in gm.graph.nodes}
    owners = [b.name for b in backends.registered() if b.owned_ops() & present]
    if len(owners) > 1:
        raise ValueError(f"mlagraph backend: the graph mixes ops private to backends {owners}")
    return backends.get(owners[0] if owners else "reference")


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
            attention_backend: str | None = None, **torch_compile_kwargs: Any):
    """``torch.compile`` with mlagraph's passes for the model's attention backend.

    Args:
        model_or_fn: a DeepseekForCausalLM (its ``.backend`` names the attention backend) or any
            callable (then ``attention_backend`` or the graph's ops decide).
        backend: "mlagraph" (Inductor) or "mlagraph_eager" (AOT graph run eagerly).
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

    return _WithoutDuckShapes(torch.compile(model_or_fn, backend=compiler, **torch_compile_kwargs))


class _WithoutDuckShapes:
    """Calls a compiled function with duck shaping off.

    By default dynamo gives two dimensions one symbol when they happen to be equal at the first
    trace (a 1-token-per-request batch has as many tokens as logits rows) and recompiles when
    they later differ. Our token, request and logits dimensions are independent, so we trace
    them as such: one graph per batch-plan variant, for every size.
    """

    def __init__(self, compiled):
        self._compiled = compiled

    def __call__(self, *args, **kwargs):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return self._compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._compiled, name)
