"""Runs the model over one scheduled step: owns the caches, the (compiled) step functions and
the CUDA graphs; knows nothing of queues, sampling or stopping.

A step is a list of ``(request, new tokens)``; the runner turns it into a
:class:`~mlagraph.model.batch.Batch` (host plan and forward method decided by
:func:`~mlagraph.model.batch.build_batch`), or, for a decode step that fits the captured
buckets, fills the static buffers and replays a graph (DecodeGraphs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import cuda_graphs as graphs
from ..model.batch import BatchKind, build_batch, plan_step
from ..model.deepseek import DeepseekForCausalLM
from ..ops import host_plan
from .progress import CompileProgress
from .request import Request

# compile_options keys the Engine passes on to mlagraph.compile; the rest it sets itself
COMPILE_OPTIONS = ("mode", "passes", "strict", "lint", "options", "regional")


class ModelRunner:
    """The model, its paged caches and how each step runs.

    Args: as :class:`~mlagraph.engine.Engine`'s, which checks them.
    """

    def __init__(self, model: DeepseekForCausalLM, *, num_pages: int, page_size: int, max_num_seqs: int,
                 max_model_len: int, compile: bool, compile_backend: str, compile_options: dict | None,
                 cuda_graphs: bool, cuda_graph_batch_sizes: Sequence[int] | None, dsa_dense_max_kv_len: int,
                 progress: bool | None):
        self.model = model
        self.device = model.lm_head.weight.device
        self.page_size, self.max_num_seqs, self.max_model_len = page_size, max_num_seqs, max_model_len
        self.dsa_dense_max_kv_len = dsa_dense_max_kv_len
        self.caches = model.allocate_caches(num_pages, page_size)
        self.step_fn = model
        self.compiled = []  # the CompiledSteps this runner owns
        self.compile_progress = CompileProgress(progress) if compile else None
        self.compile_kwargs = None  # what mlagraph.compile was given (the speculator compiles its steps alike)
        decode_fn, inductor_graphs = model, False
        if compile:
            from ..compiler import compile as mlagraph_compile

            # Dynamic token / request dimensions: one graph per batch-plan variant, whatever the
            # batch size, a lone request included (not padded: a padding request would run the
            # whole model, and at batch 1 its row doubled the MoE's work). The model and the
            # passes keep Inductor from asking whether a size is 1 (docs/design.md).
            options = dict(compile_options or {})
            mode = options.pop("mode", None)
            kw = dict(backend=compile_backend, fullgraph=True, dynamic=True, **options)
            self.compile_kwargs = dict(kw, mode=mode)
            inductor_graphs = mode is not None and bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))
            # Prefill never runs in Inductor's graphs (one per prompt length would pile up).
            self.step_fn = mlagraph_compile(model, **kw, mode=None if inductor_graphs else mode)
            # Inductor's CUDA-graph trees record one graph per compiled function call: a
            # regional step would replay 2L+2 of them per decode step, so that decode step is
            # compiled whole (our own capture, below, records the regional step in one graph).
            decode_fn = mlagraph_compile(model, **{**kw, "regional": False}, mode=mode) if inductor_graphs else self.step_fn
            self.compiled = [self.step_fn] + ([decode_fn] if inductor_graphs else [])
        self.decode_fn, self.inductor_graphs = decode_fn, inductor_graphs
        self.graphs = None  # DecodeGraphs | InductorDecodeGraphs
        if cuda_graphs:
            self.graphs = self._capture(decode_fn, inductor_graphs, cuda_graph_batch_sizes, progress)
        # wall time of the capture, its warm-up runs included, the compiling they caused excluded
        self.capture_seconds = 0.0 if self.graphs is None else self.graphs.capture_seconds

    @torch.no_grad()
    def run(self, plan: list[tuple[Request, list[int]]], *, all_logits: bool) -> torch.Tensor:
        """Runs one step: float32 logits at each entry's last new token [len(plan), V], or at
        every new token with ``all_logits`` [sum of new tokens, V]. Synchronises on CUDA, so
        the caller's wall time is the step's."""
        graphed = (self.graphs is not None and not all_logits and len(plan) <= self.graphs.max_batch
                   and all(r.decoding and len(t) == 1 for r, t in plan))
        if graphed:
            logits = self._replay(plan)
        else:
            batch = build_batch(
                self.model.backend.capabilities, [t for _, t in plan], [r.num_cached for r, _ in plan],
                [r.pages for r, _ in plan], self.page_size, is_decode=[r.decoding for r, _ in plan],
                dsa=self.model.config.uses_dsa, dsa_dense_max_kv_len=self.dsa_dense_max_kv_len,
                all_logits=all_logits, device=self.device,
            )
            step_fn = self.step_fn
            if batch.plan.kind is BatchKind.DECODE and self.inductor_graphs:
                step_fn = self.decode_fn  # compiled with a CUDA-graph mode: Inductor's graphs
                torch.compiler.cudagraph_mark_step_begin()
            # one step: library kernels plan once from the batch's host metadata (ops/host_plan.py)
            with host_plan.step(batch.mirrors):
                if self.compile_progress is None:
                    logits = step_fn(batch, self.caches)
                else:
                    key = (batch.variant, step_fn is self.decode_fn)  # one compiled graph per variant
                    with self.compile_progress.step(key, f"{batch.plan.kind.value} ({batch.method.value})"):
                        logits = step_fn(batch, self.caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = len(plan)
        return logits if all_logits else logits[:n]

    # --- CUDA graphs -----------------------------------------------------------------------

    def _capture(self, decode_fn, inductor_graphs: bool, sizes, progress):
        if sizes is None:
            buckets = graphs.default_buckets(self.max_num_seqs)
        else:
            buckets = graphs.check_buckets(sizes, self.max_num_seqs)
        plans = graphs.decode_plans(self.model.backend.capabilities, self.model.config.uses_dsa)
        max_pages = max(math.ceil(self.max_model_len / self.page_size), 1)
        if inductor_graphs and self.model.backend.capabilities.step_metadata:
            raise ValueError(
                f"Engine: backend {self.model.backend.name!r} plans its kernels once per step, which Inductor's "
                "CUDA-graph trees cannot redo between replays: use cuda_graphs=True without "
                "compile_options={'mode': 'reduce-overhead'}")
        cls = graphs.InductorDecodeGraphs if inductor_graphs else graphs.DecodeGraphs
        return cls(decode_fn, self.caches, buckets, plans, max_pages, self.device, progress)

    def _replay(self, plan: list[tuple[Request, list[int]]]) -> torch.Tensor:
        """A one-token decode step through the CUDA graphs: logits [n, V]."""
        ps = self.page_size
        tokens, positions, slots, pages, seq_lens = [], [], [], [], []
        for r, toks in plan:
            pos = r.num_cached
            tokens.append(toks[0])
            positions.append(pos)
            slots.append(r.pages[pos // ps] * ps + pos % ps)
            pages.append(r.pages)
            seq_lens.append(pos + 1)
        # the plan is made on the host before the replay (DESIGN.md lesson 7), by the same
        # function that picks an uncaptured step's method
        n = len(plan)
        _, method = plan_step(
            self.model.backend.capabilities, [1] * n, positions, [True] * n, dsa=self.model.config.uses_dsa,
            dsa_dense_max_kv_len=self.dsa_dense_max_kv_len, graphed=True,
        )
        return self.graphs.run(method, tokens, positions, slots, pages, seq_lens)
