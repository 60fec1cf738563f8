"""The engine: requests in, tokens and text out, over a paged latent cache.

    engine = Engine(model, max_num_seqs=8, max_model_len=1024, page_size=16, prefix_caching=True)
    outs = engine.generate(["Hello", [1, 2, 3]], max_new_tokens=16)     # text needs a tokenizer
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
    for chunk in engine.generate_stream(["Hello"]): print(chunk.text, end="")
    rid = engine.add_request([1, 2, 3], max_new_tokens=4)   # the step API generate() is built on
    while engine.has_unfinished_requests(): finished = engine.step()
    engine.prompt_logprobs([[1, 2, 3, 4]])      # [tensor([lp(2|1), lp(3|1,2), lp(4|1,2,3)])]

Three parts, each in its own module: the :class:`~.scheduler.Scheduler` (admission, the token
budget of each step, pages through the :class:`~.block_manager.BlockManager` and its prefix
cache), the :class:`~.model_runner.ModelRunner` (caches, compiled steps, CUDA graphs) and, here,
sampling, stopping and the outputs.

With ``cuda_graphs=True`` (CUDA only) decode steps replay CUDA graphs captured in the
constructor, one per batch-size bucket (mlagraph.engine.cuda_graphs); prefill steps, and decode
batches larger than the largest bucket, run the (compiled) step without graphs.

With ``speculative="mtp"`` the model's multi-token-prediction layer drafts
``num_speculative_tokens`` tokens per request and each decode step verifies them
(mlagraph.engine.speculative); outputs are those of decoding without it (greedy: token for
token; sampled: in distribution).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence

import torch

from ..model.deepseek import DeepseekForCausalLM
from ..regional import compiled_units
from .block_manager import BlockManager
from .model_runner import COMPILE_OPTIONS, ModelRunner
from .request import GenerationOutput, Request, SamplingParams, StreamChunk, prompt_token_ids
from .sampler import sample
from .scheduler import Scheduler
from .stopping import TextTracker, finish_reason


@dataclasses.dataclass
class StepStats:
    """Tokens and wall time of the engine's steps: ``prefill_*`` for steps that carry any
    prompt tokens (decodes riding along in mixed steps included), ``decode_*`` for steps that
    only decode. ``prompt_tokens`` of the requests admitted, of which ``cached_prompt_tokens``
    came from the prefix cache (not computed)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: drafts verified
    accepted_tokens: int = 0  # of which the target kept

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft was verified)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class Startup:
    """Where an engine's start-up time went, in seconds: ``compile_s`` compiling graphs (with
    CUDA graphs, the decode variants compile in the constructor; the first step of every other
    variant adds its own), ``capture_s`` capturing CUDA graphs, warm-up runs included and the
    compiling they caused excluded."""

    compile_s: float
    capture_s: float


class Engine:
    """Runs a :class:`DeepseekForCausalLM` over a paged cache.

    Args:
        model: the model (any backend, dtype and device); its ``tokenizer`` (from
            ``from_pretrained``) makes text prompts and outputs work, its ``eos_token_ids``
            stop generation unless ``ignore_eos=True``.
        max_num_seqs: requests running at once.
        max_model_len: longest request (prompt + generated tokens).
        page_size: tokens per cache page; None: the backend's ``preferred_page_size`` (64 where
            FlashMLA decodes, since its dense decode reads pages of 64 only; else 16). A size
            the backend's ``page_sizes`` does not list raises (docs/design.md, page size).
        compile: run the step through :func:`mlagraph.compile` (Inductor + mlagraph's passes),
            fullgraph with dynamic token and request dimensions. The first step of each batch-plan
            variant compiles its graph (a progress line says so on a terminal).
        cuda_graphs: capture decode steps in CUDA graphs (CUDA only), one per batch-size bucket
            (and per forward method for DSA models), in the constructor. A batch pads up to
            its bucket with slot -1 rows. With ``compile_options={"mode": "reduce-overhead"}``
            Inductor's CUDA-graph trees do the capture over the same static buckets instead.
        prefill_chunk_size: token budget per step; prompts longer than it are prefilled in
            chunks over their cached prefix. None: whole prompts in one step.
        num_pages: cache pages (default: enough for max_num_seqs full-length requests; at least
            one full-length request's worth).
        seed: seed of the sampler's generator (temperature > 0).
        compile_backend: with compile=True, "mlagraph" (Inductor) or "mlagraph_eager" (the
            same passes on the AOT graph, executed without code generation).
        dsa_dense_max_kv_len: DSA models (V3.2; V4's CSA) run a batch with dense attention when no
            request's kv length exceeds this (default: where dense is exact, index_topk for V3.2,
            the config's ``dsa_dense_max_kv_len`` when it has one). Larger
            values approximate DSA; 0 forces sparse.
        compile_options: more keyword arguments for :func:`mlagraph.compile` (``mode``,
            ``passes``, ``strict``, ``lint``, ``options``, ``regional``: False compiles the
            whole step per variant instead of each kind of layer block once). A mode that makes
            Inductor capture CUDA graphs ("reduce-overhead", "max-autotune") applies to decode
            steps only (compiled whole); prefill runs a separately compiled step without graphs.
        cuda_graph_batch_sizes: the buckets (default: powers of two up to max_num_seqs, and
            max_num_seqs). With compile=True sizes below 2 run in the 2 bucket.
        progress: progress messages while compiling and capturing (None: only on a terminal).
        prefix_caching: reuse the cache pages of prompt prefixes computed before (full pages,
            matched by a hash chain of their tokens; least recently used evicted first).
            Results equal prefix_caching=False; ``stats.cached_prompt_tokens`` counts the reuse.
        speculative: None, or "mtp": speculative decoding drafted by the model's MTP layer
            (``model.mtp``; DeepSeek-V3 / V3.2 checkpoints carry one), verified by the model in
            one multi-token decode step per request (captured per bucket with cuda_graphs).
            ``stats`` counts drafted and accepted tokens; ``stats.decode_tokens`` counts
            generated tokens.
        num_speculative_tokens: drafts per request and step with speculative="mtp", 1 to 3.
    """

    def __init__(
        self, model: DeepseekForCausalLM, max_num_seqs: int = 8, max_model_len: int = 1024, page_size: int | None = None,
        compile: bool = False, cuda_graphs: bool = False, prefill_chunk_size: int | None = None,
        num_pages: int | None = None, seed: int = 0, compile_backend: str = "mlagraph",
        dsa_dense_max_kv_len: int | None = None, compile_options: dict | None = None,
        cuda_graph_batch_sizes: Sequence[int] | None = None, progress: bool | None = None,
        prefix_caching: bool = False, speculative: str | None = None, num_speculative_tokens: int = 1,
    ):
        if page_size is None:
            page_size = model.backend.capabilities.preferred_page_size
        _check_args(model, max_num_seqs, max_model_len, page_size, compile, cuda_graphs, prefill_chunk_size,
                    num_pages, compile_backend, compile_options, cuda_graph_batch_sizes, progress, prefix_caching)
        spec_k = _check_speculative(model, speculative, num_speculative_tokens, max_model_len, page_size,
                                    num_pages, compile_options)
        if dsa_dense_max_kv_len is None:
            # The longest kv length whose sparse selection keeps every key, so dense is exact: the
            # config says so where that is not index_topk (V4 selects compressed entries).
            dsa_dense_max_kv_len = getattr(model.config, "dsa_dense_max_kv_len", model.config.index_topk)
        if not isinstance(dsa_dense_max_kv_len, int) or dsa_dense_max_kv_len < 0:
            raise ValueError(f"Engine: dsa_dense_max_kv_len: expected an int >= 0 or None, got {dsa_dense_max_kv_len!r}")
        self.dsa_dense_max_kv_len = dsa_dense_max_kv_len
        self.model = model
        self.tokenizer = getattr(model, "tokenizer", None)  # models built by hand may carry none
        self.eos_token_ids = tuple(getattr(model, "eos_token_ids", ()))
        self.max_num_seqs, self.max_model_len, self.page_size = max_num_seqs, max_model_len, page_size
        self.prefill_chunk_size = prefill_chunk_size
        pages_per_seq = math.ceil((max_model_len + spec_k) / page_size)  # a verify step writes k slots past the end
        self.num_pages = num_pages if num_pages is not None else max_num_seqs * pages_per_seq
        self.prefix_caching = prefix_caching
        # speculation: a page's prefix-cache key covers the token after it (speculative.py says why)
        self.allocator = BlockManager(self.num_pages, page_size, prefix_caching=prefix_caching,
                                      lookahead=1 if spec_k else 0)
        self.stats = StepStats()
        self.scheduler = Scheduler(self.allocator, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                   prefill_chunk_size=prefill_chunk_size, speculative_tokens=spec_k)
        self.runner = ModelRunner(
            model, num_pages=self.num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, compile=compile, compile_backend=compile_backend,
            compile_options=compile_options, cuda_graphs=cuda_graphs and not spec_k,
            cuda_graph_batch_sizes=cuda_graph_batch_sizes, dsa_dense_max_kv_len=dsa_dense_max_kv_len,
            progress=progress,
        )
        self.device = self.runner.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._ids = itertools.count()
        self.speculator = None  # MTPSpeculator with speculative="mtp": it runs every step then
        if spec_k:
            from .speculative import MTPSpeculator

            self.speculator = MTPSpeculator(self, spec_k, cuda_graphs, cuda_graph_batch_sizes, progress)

    @property
    def caches(self):
        return self.runner.caches

    @property
    def graphs(self):
        """The decode CUDA graphs (None without cuda_graphs): the verify steps' with speculation."""
        return self.runner.graphs if self.speculator is None else self.speculator.verify_graphs

    @property
    def compiled_graphs(self) -> int:
        """Graphs dynamo compiled for this engine's steps so far: one per batch-plan variant the
        engine has run (0 without compile). Each engine owns its graphs: no other engine or
        model in the process adds to them or recompiles them."""
        return sum(u.num_graphs for u in compiled_units(self.runner.compiled))

    @property
    def startup(self) -> Startup:
        """Compile and capture time so far (:class:`Startup`)."""
        r = self.runner
        return Startup(compile_s=sum(u.compile_seconds for u in compiled_units(r.compiled)), capture_s=r.capture_seconds)

    # --- the step API --------------------------------------------------------------------

    def add_request(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0,
                    stop_token_ids: Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                    ignore_eos: bool = False) -> int:
        """Queues one request; returns its id. ``prompt``: token ids, a string or a conversation
        ([{"role": ..., "content": ...}], rendered with the chat template) — the last two need
        the model's tokenizer. Everything is checked here, before anything changes."""
        req = self._make_request(prompt, "add_request: prompt", self._params("add_request", max_new_tokens,
                                 temperature, stop_token_ids, stop, ignore_eos))
        self.scheduler.add(req)
        return req.id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[GenerationOutput]:
        """Runs one engine step over the queued and running requests; returns those that
        finished in it (each with its ``request_id``)."""
        return [req.output() for req, _ in self._advance() if req.finish_reason is not None]

    def abort_all(self) -> int:
        """Drops every queued and running request, releasing their pages; returns how many."""
        return len(self.scheduler.abort_all())

    # --- built on it ---------------------------------------------------------------------

    def generate(self, prompts: Sequence, max_new_tokens: int = 16, temperature: float = 0.0, logprobs: bool = True,
                 stop_token_ids: Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False) -> list[GenerationOutput]:
        """Generates for each prompt (token ids, strings or conversations; greedy when
        temperature == 0) until it stops (see mlagraph.engine.stopping): outputs in prompt order.
        ``logprobs`` are always computed (cheap); the flag is kept for API compatibility."""
        reqs = self._start("generate", prompts, max_new_tokens, temperature, stop_token_ids, stop, ignore_eos)
        try:
            while self.scheduler.has_unfinished:
                self._advance()
        finally:  # on an error too: no request keeps its pages
            self.scheduler.abort_all()
        return [r.output() for r in reqs]

    def generate_stream(self, prompts: Sequence, max_new_tokens: int = 16, temperature: float = 0.0,
                        stop_token_ids: Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                        ignore_eos: bool = False) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, but yields a :class:`StreamChunk` per generated token as the
        steps run (``chunk.index``: which prompt). Closing the iterator early drops the rest."""
        reqs = self._start("generate_stream", prompts, max_new_tokens, temperature, stop_token_ids, stop, ignore_eos)
        index = {r.id: i for i, r in enumerate(reqs)}
        try:
            while self.scheduler.has_unfinished:
                for req, tok in self._advance():
                    done = req.finish_reason is not None
                    text = req.text.releasable(done) if req.text is not None else None
                    yield StreamChunk(index[req.id], tok, text, req.finish_reason, req.stop_reason)
        finally:
            self.scheduler.abort_all()

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence, chunk_size: int | None = None) -> list[torch.Tensor]:
        """log p(tok_t | tok_<t) for t = 1..len-1 of each prompt: float32 tensors [len-1].

        ``chunk_size`` prefills each prompt in chunks of that many tokens over its cached
        prefix. Every position's logits are needed, so nothing is taken from the prefix cache;
        with prefix caching on, the pages computed here are cached for later requests (not with
        speculative decoding: the MTP layer's rows are not computed here).
        """
        self._check_idle("prompt_logprobs")
        ids = self._prompt_ids(prompts, "prompt_logprobs", max_len=self.max_model_len)
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"prompt_logprobs: chunk_size: expected a positive int or None, got {chunk_size!r}")
        params = SamplingParams(max_new_tokens=1)
        pending = [Request(next(self._ids), list(p), len(p), params) for p in ids]
        rows: dict[int, list[torch.Tensor]] = {r.id: [] for r in pending}
        results = {}
        try:
            while pending or self.scheduler.running:
                while pending and len(self.scheduler.running) < self.max_num_seqs and \
                        self.scheduler.admit(pending[0], reuse_prefix=False):
                    pending.pop(0)
                group = self.scheduler.running
                step = self.scheduler.plan(group, chunk_size or self.prefill_chunk_size)
                logits = self._run(step, all_logits=True)
                row = 0
                for req, toks in step:
                    rows[req.id].append(logits[row : row + len(toks)])
                    row += len(toks)
                for req in self.scheduler.advance(step, cache_pages=self.speculator is None):
                    logp = torch.log_softmax(torch.cat(rows.pop(req.id))[:-1], dim=-1)  # predictions of tokens 1..n-1
                    target = torch.tensor(req.tokens[1:], device=logp.device)
                    results[req.id] = logp.gather(1, target[:, None])[:, 0].cpu()
                    self.scheduler.finish(req)
        finally:
            self.scheduler.abort_all()
        return [results[k] for k in sorted(results)]

    # --- internals -----------------------------------------------------------------------

    def _params(self, caller, max_new_tokens, temperature, stop_token_ids, stop, ignore_eos) -> SamplingParams:
        params = SamplingParams.checked(caller, self.model.config.vocab_size, max_new_tokens=max_new_tokens,
                                        temperature=temperature, stop_token_ids=stop_token_ids, stop=stop,
                                        ignore_eos=ignore_eos)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{caller}: stop: stop strings need the model's tokenizer, and the model has none; "
                             f"give stop_token_ids instead")
        return params

    def _prompt_ids(self, prompts, caller: str, max_len: int) -> list[list[int]]:
        """Every prompt's token ids, checked before any state changes (a rejected call changes nothing)."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"{caller}: prompts: expected a non-empty list of prompts (token-id lists, strings or "
                             f"conversations), got {prompts!r:.100}")
        vocab = self.model.config.vocab_size
        out = [prompt_token_ids(p, f"prompts[{i}]", vocab, self.tokenizer) for i, p in enumerate(prompts)]
        for i, p in enumerate(out):
            if len(p) > self.max_model_len:
                raise ValueError(f"prompts[{i}]: length {len(p)} exceeds max_model_len={self.max_model_len}")
            if len(p) > max_len:
                raise ValueError(f"prompts[{i}]: length {len(p)} leaves no room to generate within "
                                 f"max_model_len={self.max_model_len}")
        return out

    def _make_request(self, prompt, where: str, params: SamplingParams, ids: list[int] | None = None) -> Request:
        if ids is None:
            ids = prompt_token_ids(prompt, where, self.model.config.vocab_size, self.tokenizer)
            if len(ids) >= self.max_model_len:
                raise ValueError(f"{where}: length {len(ids)} leaves no room to generate within "
                                 f"max_model_len={self.max_model_len}")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        text = TextTracker(self.tokenizer, params.stop) if self.tokenizer is not None else None
        return Request(next(self._ids), list(ids), len(ids), params, frozenset(stop_ids), text)

    def _check_idle(self, caller: str) -> None:
        n = len(self.scheduler.running) + len(self.scheduler.waiting)
        if n:
            raise ValueError(f"{caller}: expected no requests in flight, got {n} added with add_request; "
                             f"run step() until has_unfinished_requests() is False, or abort_all()")

    def _start(self, caller, prompts, max_new_tokens, temperature, stop_token_ids, stop, ignore_eos) -> list[Request]:
        self._check_idle(caller)
        ids = self._prompt_ids(prompts, caller, max_len=self.max_model_len - 1)
        params = self._params(caller, max_new_tokens, temperature, stop_token_ids, stop, ignore_eos)
        reqs = [self._make_request(None, "", params, p) for p in ids]
        for r in reqs:
            self.scheduler.add(r)
        return reqs

    def _run(self, step, *, all_logits: bool) -> torch.Tensor:
        """Runs a scheduled step on the model, timed into ``stats``."""
        t0 = time.perf_counter()
        logits = self.runner.run(step, all_logits=all_logits)
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(t) for _, t in step)  # real tokens (padding excluded)
        s = self.stats
        s.steps += 1
        if all(r.decoding for r, _ in step):
            s.decode_tokens += n_tokens
            s.decode_seconds += elapsed
            s.decode_steps += 1
        else:
            s.prefill_tokens += n_tokens
            s.prefill_seconds += elapsed
        return logits

    def _advance(self) -> list[tuple[Request, int]]:
        """One step: schedule, run, sample, stop. Returns (request, token sampled) pairs;
        finished requests have released their pages. On an error every request is dropped
        (their pages released) and the error re-raised: the engine stays usable."""
        try:
            admitted_before = set(map(id, self.scheduler.running))
            step = self.scheduler.schedule()
            for r in self.scheduler.running:
                if id(r) not in admitted_before:
                    self.stats.prompt_tokens += r.prompt_len
                    self.stats.cached_prompt_tokens += r.num_cached_prompt_tokens
            if not step:
                return []
            if self.speculator is not None:
                return self.speculator.advance(step)
            logits = self._run(step, all_logits=False)
            rows = logits.unbind(0)  # one call for every row's view
            row_of = {id(r): i for i, (r, _) in enumerate(step)}
            sampled = []
            for req in self.scheduler.advance(step):
                tok, logp = sample(rows[row_of[id(req)]], req.params.temperature, self.generator)
                self._append(req, tok, logp)
                sampled.append((req, tok))
            for req, _ in sampled:
                if req.finish_reason is not None:
                    self.scheduler.finish(req)
            return sampled
        except BaseException:
            self.scheduler.abort_all()
            raise

    def _append(self, req: Request, tok: int, logp: float) -> None:
        req.tokens.append(tok)
        req.logprobs.append(logp)
        matched = req.text.push(tok) if req.text is not None else None
        req.finish_reason, req.stop_reason = finish_reason(
            len(req.tokens), req.num_generated, tok, req.stop_ids, matched, req.params.max_new_tokens,
            self.max_model_len,
        )


def _check_speculative(model, speculative, k, max_model_len, page_size, num_pages, compile_options) -> int:
    """The speculative arguments, checked; returns the drafts per step (0: no speculation)."""
    if speculative is None:
        if k != 1:
            raise ValueError(f"Engine: num_speculative_tokens: given ({k!r}) but speculative=None")
        return 0
    if speculative != "mtp":
        raise ValueError(f"Engine: speculative: expected None or 'mtp', got {speculative!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 3:
        raise ValueError(f"Engine: num_speculative_tokens: expected an int in 1..3, got {k!r}")
    if getattr(model, "mtp", None) is None:
        cfg = model.config
        why = (f"its config has num_nextn_predict_layers={getattr(cfg, 'num_nextn_predict_layers', 0)}, "
               f"or its checkpoint has no model.layers.{cfg.num_hidden_layers}.* weights (transformers' "
               f"save_pretrained drops them), or it runs tensor parallel")
        raise ValueError(f"Engine: speculative='mtp': expected a model with an MTP layer (model.mtp), got one "
                         f"without ({why})")
    if max_model_len + k > model.config.max_position_embeddings:
        raise ValueError(
            f"Engine: max_model_len: expected <= max_position_embeddings - num_speculative_tokens "
            f"({model.config.max_position_embeddings} - {k}: verify steps reach {k} positions past the end), "
            f"got {max_model_len}")
    need = math.ceil((max_model_len + k) / page_size)
    if num_pages is not None and num_pages < need:
        raise ValueError(f"Engine: num_pages: expected at least {need} (one request of max_model_len={max_model_len} "
                         f"tokens and {k} speculative slots in pages of {page_size}), got {num_pages}")
    mode = (compile_options or {}).get("mode")
    if mode is not None and torch._inductor.list_mode_options(mode).get("triton.cudagraphs"):
        raise ValueError(f"Engine: compile_options: mode {mode!r} captures Inductor's CUDA graphs, which "
                         f"speculative='mtp' does not use; use cuda_graphs=True instead")
    return k


def _check_args(model, max_num_seqs, max_model_len, page_size, compile, cuda_graphs, prefill_chunk_size, num_pages,
                compile_backend, compile_options, cuda_graph_batch_sizes, progress, prefix_caching) -> None:
    """Every constructor argument, before anything is allocated or compiled."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Engine: {name}: expected a positive int, got {value!r}")
    allowed = getattr(model.backend.capabilities, "page_sizes", None)
    if allowed is not None and page_size not in allowed:
        raise ValueError(f"Engine: page_size: backend {model.backend.name!r} takes pages of {sorted(allowed)} tokens, "
                         f"got {page_size}")
    for name, value in (("prefill_chunk_size", prefill_chunk_size), ("num_pages", num_pages)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"Engine: {name}: expected a positive int or None, got {value!r}")
    for name, value in (("compile", compile), ("cuda_graphs", cuda_graphs), ("prefix_caching", prefix_caching)):
        if not isinstance(value, bool):
            raise ValueError(f"Engine: {name}: expected a bool, got {value!r}")
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"Engine: progress: expected a bool or None, got {progress!r}")
    if max_model_len > model.config.max_position_embeddings:
        raise ValueError(
            f"Engine: max_model_len: expected <= max_position_embeddings "
            f"({model.config.max_position_embeddings}), got {max_model_len}"
        )
    need = math.ceil(max_model_len / page_size)
    if num_pages is not None and num_pages < need:
        raise ValueError(
            f"Engine: num_pages: expected at least {need} (one request of max_model_len={max_model_len} tokens in "
            f"pages of {page_size}), got {num_pages}"
        )
    if compile_options is not None and not isinstance(compile_options, dict):
        raise ValueError(f"Engine: compile_options: expected a dict or None, got {compile_options!r}")
    if compile_options and not compile:
        raise ValueError(f"Engine: compile_options: given {sorted(compile_options)} but compile=False")
    unknown = sorted(set(compile_options or ()) - set(COMPILE_OPTIONS))
    if unknown:
        raise ValueError(f"Engine: compile_options: expected keys among {list(COMPILE_OPTIONS)}, got unknown {unknown}")
    if compile and compile_backend not in ("mlagraph", "mlagraph_eager"):
        raise ValueError(f"Engine: compile_backend: expected 'mlagraph' or 'mlagraph_eager', got {compile_backend!r}")
    device = model.lm_head.weight.device
    if cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"Engine: cuda_graphs=True needs a model on a CUDA device, got {device}")
        caps = model.backend.capabilities
        unsafe = sorted(set(model.backend.op_names) - caps.cuda_graph_safe)
        if unsafe:
            raise ValueError(
                f"Engine: cuda_graphs=True: backend {model.backend.name!r} declares ops that are not "
                f"CUDA-graph safe: {unsafe}"
            )
    elif cuda_graph_batch_sizes is not None:
        raise ValueError("Engine: cuda_graph_batch_sizes: given but cuda_graphs=False")
