"""A small inference engine: paged latent cache, continuous batching, chunked prefill, sampling.

    engine = Engine(model, max_num_seqs=8, max_model_len=1024, page_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
    outs[0].token_ids, outs[0].logprobs
    engine.prompt_logprobs([[1, 2, 3, 4]])      # [tensor([lp(2|1), lp(3|1,2), lp(4|1,2,3)])]

Each step the scheduler packs one batch: every running request decodes one token, and prompt
chunks fill the rest of the token budget (``prefill_chunk_size``; unlimited when None). The
batch plan and the forward method are decided on the host before the step runs
(mlagraph.model.batch). Pages are allocated from a free list; the cache holds
``max_num_seqs * ceil(max_model_len / page_size)`` pages unless told otherwise, so admitted
requests never run out.

With ``cuda_graphs=True`` (CUDA only) decode steps replay CUDA graphs captured in the
constructor, one per batch-size bucket (mlagraph.model.cuda_graphs); prefill steps, and decode
batches larger than the largest bucket, run the (compiled) step without graphs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch

from . import cuda_graphs as graphs
from .batch import BatchKind, build_batch, plan_step
from .deepseek import DeepseekForCausalLM


class PageAllocator:
    """A free list of cache pages."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"page allocator: asked for {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


@dataclasses.dataclass
class GenerationOutput:
    """token_ids: generated tokens; logprobs: log p(token) under the model (temperature 1)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "length" | "stop" | "max_model_len"
    prompt_len: int


@dataclasses.dataclass
class _Request:
    index: int
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    max_new_tokens: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose latents are in the cache
    generated_logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def decoding(self) -> bool:
        return self.num_cached >= self.prompt_len


@dataclasses.dataclass
class StepStats:
    """Tokens and wall time of the engine's steps: ``prefill_*`` for steps that carry any
    prompt tokens (decodes riding along in mixed steps included), ``decode_*`` for steps that
    only decode."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0


class Engine:
    """Runs a :class:`DeepseekForCausalLM` over a paged cache.

    Args:
        model: the model (any backend, dtype and device).
        max_num_seqs: requests running at once.
        max_model_len: longest request (prompt + generated tokens).
        page_size: tokens per cache page.
        compile: run the step through :func:`mlagraph.compile` (Inductor + mlagraph's passes),
            fullgraph with dynamic token and request dimensions.
        cuda_graphs: capture decode steps in CUDA graphs (CUDA only), one per batch-size bucket
            (and per forward method for DSA models), in the constructor. A batch pads up to
            its bucket with slot -1 rows. With ``compile_options={"mode": "reduce-overhead"}``
            Inductor's CUDA-graph trees do the capture over the same static buckets instead.
        prefill_chunk_size: token budget per step; prompts longer than it are prefilled in
            chunks over their cached prefix. None: whole prompts in one step.
        num_pages: cache pages (default: enough for max_num_seqs full-length requests).
        seed: seed of the sampler's generator (temperature > 0).
        compile_backend: with compile=True, "mlagraph" (Inductor) or "mlagraph_eager" (the
            same passes on the AOT graph, executed without code generation).
        dsa_dense_max_kv_len: DSA models (V3.2; V4's CSA) run a batch with dense attention when no
            request's kv length exceeds this (default: where dense is exact, index_topk for V3.2,
            the config's ``dsa_dense_max_kv_len`` when it has one). Larger
            values approximate DSA; 0 forces sparse.
        compile_options: more keyword arguments for :func:`mlagraph.compile` (``mode``,
            ``passes``, ``strict``, ``lint``, ``options``). A mode that makes Inductor capture
            CUDA graphs ("reduce-overhead", "max-autotune") applies to decode steps only;
            prefill runs a separately compiled step without graphs.
        cuda_graph_batch_sizes: the buckets (default: powers of two up to max_num_seqs, and
            max_num_seqs). With compile=True sizes below 2 run in the 2 bucket.
        progress: show a progress bar while capturing (None: only on a terminal).
    """

    def __init__(
        self, model: DeepseekForCausalLM, max_num_seqs: int = 8, max_model_len: int = 1024, page_size: int = 16,
        compile: bool = False, cuda_graphs: bool = False, prefill_chunk_size: int | None = None,
        num_pages: int | None = None, seed: int = 0, compile_backend: str = "mlagraph",
        dsa_dense_max_kv_len: int | None = None, compile_options: dict | None = None,
        cuda_graph_batch_sizes: Sequence[int] | None = None, progress: bool | None = None,
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name}: expected a positive int, got {value!r}")
        for name, value in (("prefill_chunk_size", prefill_chunk_size), ("num_pages", num_pages)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Engine: {name}: expected a positive int or None, got {value!r}")
        if max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"Engine: max_model_len: expected <= max_position_embeddings "
                f"({model.config.max_position_embeddings}), got {max_model_len}"
            )
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError(f"Engine: compile_options: expected a dict or None, got {compile_options!r}")
        if compile_options and not compile:
            raise ValueError(f"Engine: compile_options: given {sorted(compile_options)} but compile=False")
        self.device = model.lm_head.weight.device
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"Engine: cuda_graphs=True needs a model on a CUDA device, got {self.device}")
            caps = model.backend.capabilities
            unsafe = sorted(set(model.backend.op_names) - caps.cuda_graph_safe)
            if unsafe:
                raise ValueError(
                    f"Engine: cuda_graphs=True: backend {model.backend.name!r} declares ops that are not "
                    f"CUDA-graph safe: {unsafe}"
                )
        elif cuda_graph_batch_sizes is not None:
            raise ValueError("Engine: cuda_graph_batch_sizes: given but cuda_graphs=False")
        if dsa_dense_max_kv_len is None:
            # The longest kv length whose sparse selection keeps every key, so dense is exact: the
            # config says so where that is not index_topk (V4 selects compressed entries).
            dsa_dense_max_kv_len = getattr(model.config, "dsa_dense_max_kv_len", model.config.index_topk)
        if not isinstance(dsa_dense_max_kv_len, int) or dsa_dense_max_kv_len < 0:
            raise ValueError(f"Engine: dsa_dense_max_kv_len: expected an int >= 0 or None, got {dsa_dense_max_kv_len!r}")
        self.dsa_dense_max_kv_len = dsa_dense_max_kv_len
        self.model = model
        self.max_num_seqs, self.max_model_len, self.page_size = max_num_seqs, max_model_len, page_size
        self.prefill_chunk_size = prefill_chunk_size
        pages_per_seq = math.ceil(max_model_len / page_size)
        self.num_pages = num_pages if num_pages is not None else max_num_seqs * pages_per_seq
        self.allocator = PageAllocator(self.num_pages)
        self.caches = model.allocate_caches(self.num_pages, page_size)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = StepStats()
        self._step_fn = model
        self._compiled = []  # the CompiledSteps this engine owns
        self._min_reqs = 1
        decode_fn, inductor_graphs = model, False
        if compile:
            from ..compiler import compile as mlagraph_compile

            # Dynamic token / request dimensions: one graph per batch-plan variant, whatever the
            # batch size. Batches are padded to >= 2 requests because torch.compile treats a
            # size of 1 as a special case (it would compile that size separately).
            options = dict(compile_options or {})
            mode = options.pop("mode", None)
            kw = dict(backend=compile_backend, fullgraph=True, dynamic=True, **options)
            inductor_graphs = mode is not None and bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))
            # Prefill never runs in Inductor's graphs (one per prompt length would pile up).
            self._step_fn = mlagraph_compile(model, **kw, mode=None if inductor_graphs else mode)
            decode_fn = mlagraph_compile(model, **kw, mode=mode) if inductor_graphs else self._step_fn
            self._min_reqs = 2
            self._compiled = [self._step_fn] + ([decode_fn] if inductor_graphs else [])
        self._decode_fn, self._inductor_graphs = decode_fn, inductor_graphs

        self.graphs = None  # DecodeGraphs | InductorDecodeGraphs
        if cuda_graphs:
            self.graphs = self._capture(decode_fn, inductor_graphs, cuda_graph_batch_sizes, progress)

    # --- public API ----------------------------------------------------------------------

    @property
    def compiled_graphs(self) -> int:
        """Graphs dynamo compiled for this engine's steps so far: one per batch-plan variant the
        engine has run (0 without compile). Each engine owns its graphs: no other engine or
        model in the process adds to them or recompiles them."""
        return sum(f.num_graphs for f in self._compiled)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
        logprobs: bool = True, stop_token_ids: Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Generates up to ``max_new_tokens`` for each prompt (greedy when temperature == 0).

        Stops a request early at a token of ``stop_token_ids`` or when it reaches max_model_len.
        ``logprobs`` are always computed (cheap); the flag is kept for API compatibility.
        """
        self._check_prompts(prompts)
        for i, p in enumerate(prompts):
            if len(p) >= self.max_model_len:
                raise ValueError(
                    f"prompts[{i}]: length {len(p)} leaves no room to generate within max_model_len={self.max_model_len}"
                )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"generate: temperature: expected a finite number >= 0, got {temperature!r}")
        stop = set(stop_token_ids or ())
        reqs = [_Request(i, list(p), len(p), max_new_tokens) for i, p in enumerate(prompts)]
        waiting, running = list(reqs), []
        try:
            while waiting or running:
                while waiting and len(running) < self.max_num_seqs:
                    running.append(waiting.pop(0))
                sampled = self._step(running, all_logits=False)
                for req, logits in sampled:
                    self._append_token(req, logits, temperature, stop)
                for req in [r for r in running if r.finish_reason]:
                    self._release(req)
                    running.remove(req)
        finally:  # on an error too: no request keeps its pages
            for req in running:
                self._release(req)
        return [GenerationOutput(r.tokens[r.prompt_len:], r.generated_logprobs, r.finish_reason, r.prompt_len) for r in reqs]

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], chunk_size: int | None = None) -> list[torch.Tensor]:
        """log p(tok_t | tok_<t) for t = 1..len-1 of each prompt: float32 tensors [len-1].

        ``chunk_size`` prefills each prompt in chunks of that many tokens over its cached prefix.
        """
        self._check_prompts(prompts)
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"prompt_logprobs: chunk_size: expected a positive int or None, got {chunk_size!r}")
        results = []
        for start in range(0, len(prompts), self.max_num_seqs):
            group = [_Request(i, list(p), len(p), 0) for i, p in enumerate(prompts[start : start + self.max_num_seqs])]
            rows: list[list[torch.Tensor]] = [[] for _ in group]
            try:
                while any(r.num_cached < r.prompt_len for r in group):
                    active = [r for r in group if r.num_cached < r.prompt_len]
                    for req, logits in self._step(active, all_logits=True, chunk_size=chunk_size):
                        rows[req.index].append(logits)
            finally:
                for r in group:
                    self._release(r)
            for req, chunks in zip(group, rows):
                logp = torch.log_softmax(torch.cat(chunks)[:-1], dim=-1)  # predictions for tokens 1..n-1
                target = torch.tensor(req.tokens[1:], device=logp.device)
                results.append(logp.gather(1, target[:, None])[:, 0].cpu())
        return results

    # --- internals -----------------------------------------------------------------------

    def _capture(self, decode_fn, inductor_graphs: bool, sizes, progress):
        if sizes is None:
            buckets = graphs.default_buckets(self.max_num_seqs, self._min_reqs)
        else:
            buckets = graphs.check_buckets(sizes, self.max_num_seqs, self._min_reqs)
        plans = graphs.decode_plans(self.model.backend.capabilities, self.model.config.uses_dsa)
        max_pages = max(math.ceil(self.max_model_len / self.page_size), 1)
        cls = graphs.InductorDecodeGraphs if inductor_graphs else graphs.DecodeGraphs
        return cls(decode_fn, self.caches, buckets, plans, max_pages, self.device, progress)

    def _replay(self, plan: list) -> torch.Tensor:
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
        # the plan is made on the host before the replay (docs/design.md rule 7), by the same
        # function that picks an uncaptured step's method
        n = len(plan)
        _, method = plan_step(
            self.model.backend.capabilities, [1] * n, positions, [True] * n, dsa=self.model.config.uses_dsa,
            dsa_dense_max_kv_len=self.dsa_dense_max_kv_len, graphed=True,
        )
        return self.graphs.run(method, tokens, positions, slots, pages, seq_lens)

    def _check_prompts(self, prompts) -> None:
        """Validates everything before any state changes, so a rejected call changes nothing."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a non-empty list of token-id lists, got {prompts!r}")
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple)):
                raise ValueError(f"prompts[{i}]: expected a list of token ids, got {type(p).__name__}")
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
            if len(p) > self.max_model_len:
                raise ValueError(f"prompts[{i}]: length {len(p)} exceeds max_model_len={self.max_model_len}")
            for j, tok in enumerate(p):
                if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                    raise ValueError(f"prompts[{i}][{j}]: token id {tok!r} is outside the vocabulary [0, {vocab})")

    def _step(self, reqs: list[_Request], *, all_logits: bool, chunk_size: int | None = None):
        """Runs one batch over ``reqs``; returns [(request, logits)] for requests that reached
        the end of their known tokens (logits [V] at the last token, or [q_len, V] with all_logits)."""
        budget = chunk_size or self.prefill_chunk_size or math.inf
        decode = [r for r in reqs if r.decoding]
        prefill = [r for r in reqs if not r.decoding]
        budget -= len(decode)
        plan: list[tuple[_Request, list[int]]] = [(r, r.tokens[r.num_cached :]) for r in decode]
        for r in prefill:
            take = min(r.prompt_len - r.num_cached, max(budget, 0))
            if take <= 0 and plan:
                continue
            take = max(take, 1)
            plan.append((r, r.tokens[r.num_cached : r.num_cached + take]))
            budget -= take
        for r, toks in plan:
            need = math.ceil((r.num_cached + len(toks)) / self.page_size) - len(r.pages)
            if need > 0:
                r.pages += self.allocator.allocate(need)
        t0 = time.perf_counter()
        graphed = (self.graphs is not None and not all_logits and len(plan) <= self.graphs.max_batch
                   and all(r.decoding and len(t) == 1 for r, t in plan))
        if graphed:
            logits = self._replay(plan)
        else:
            batch = build_batch(
                self.model.backend.capabilities, [t for _, t in plan], [r.num_cached for r, _ in plan],
                [r.pages for r, _ in plan], self.page_size, is_decode=[r.decoding for r, _ in plan],
                dsa=self.model.config.uses_dsa, dsa_dense_max_kv_len=self.dsa_dense_max_kv_len,
                all_logits=all_logits, min_reqs=self._min_reqs, device=self.device,
            )
            step_fn = self._step_fn
            if batch.plan.kind is BatchKind.DECODE and self._inductor_graphs:
                step_fn = self._decode_fn  # compiled with a CUDA-graph mode: Inductor's graphs
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                logits = step_fn(batch, self.caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(t) for _, t in plan)  # real tokens (padding excluded)
        self.stats.steps += 1
        if all(r.decoding for r, _ in plan):
            self.stats.decode_tokens += n_tokens
            self.stats.decode_seconds += elapsed
        else:
            self.stats.prefill_tokens += n_tokens
            self.stats.prefill_seconds += elapsed

        out, row = [], 0
        rows = None if all_logits else logits.unbind(0)  # one call for every row's view
        for r, toks in plan:
            n = len(toks) if all_logits else 1
            r.num_cached += len(toks)
            if all_logits:
                out.append((r, logits[row : row + n]))
            elif r.num_cached == len(r.tokens):
                out.append((r, rows[row]))
            row += n
        return out

    def _append_token(self, req: _Request, logits: torch.Tensor, temperature: float, stop: set[int]) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        if temperature == 0:
            tok = int(torch.argmax(logp))
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=self.generator))
        req.tokens.append(tok)
        req.generated_logprobs.append(float(logp[tok]))
        n_new = len(req.tokens) - req.prompt_len
        if tok in stop:
            req.finish_reason = "stop"
        elif n_new >= req.max_new_tokens:
            req.finish_reason = "length"
        elif len(req.tokens) >= self.max_model_len:
            req.finish_reason = "max_model_len"

    def _release(self, req: _Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
