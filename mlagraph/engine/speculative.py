"""Speculative decoding with DeepSeek's MTP layer: ``Engine(model, speculative="mtp",
num_speculative_tokens=k)``.

One engine step, for the scheduled requests (mlagraph.model.mtp has the layer itself):

1. target: the main model runs each request's new tokens: a decoding request's last token and
   its k drafts (s_q = k + 1: one multi-token decode step when every request decodes, replayed
   from a CUDA graph per bucket), prompt chunks as usual. It returns logits and final hidden
   states.
2. accept: :func:`~mlagraph.engine.sampler.verify` keeps a prefix of each request's drafts and
   adds one token from the target; the emitted tokens pass the stopping rules one by one.
3. catch up: the MTP layer runs over the positions step 1 made valid, reading (h_p, t_{p+1});
   at the last of them its output drafts the first next token. A decoding request always
   brings k + 1 rows here (rows past its accepted ones hold filler), so this step is uniform
   and captured too.
4. chain: k - 1 one-token MTP steps draft the rest, each fed the previous step's output.

Rollback is by length. The target wrote cache rows (latent, and V3.2's indexer keys) for all
k + 1 tokens; a request's ``num_cached`` then counts only the accepted ones, every later step
reads keys below its length only, and the next verify step starts at the first rejected
position and so rewrites every rejected row before anything reads it. The MTP layer's rows
past the accepted ones (filler, chained drafts) are rewritten the same way by the next catch-up.
No page ever holds only rejected rows: the next verify writes exactly there, so the request
keeps the pages (the scheduler assured k slots past each request's end at admission).
Prefix caching keys a page by one token past its end (BlockManager ``lookahead``), since the
MTP row at a page's last slot is made from that token.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence

import torch

from . import cuda_graphs as graphs
from ..model.attention import KVCaches
from ..model.batch import build_batch, plan_step
from ..model.mtp import mtp_step, target_step
from ..regional import RegionalStep
from .request import Request
from .sampler import draft, sample, verify

# (request, its new tokens, the position of the first of them)
Entry = tuple[Request, list[int], int]


class MTPSpeculator:
    """The speculative half of an :class:`~mlagraph.engine.Engine`: runs its steps when
    ``speculative="mtp"``. ``draft_hook(request, drafts) -> drafts`` (None by default) may
    replace the MTP layer's drafts after it ran (tests and the benchmark's upper bound: a draft
    that reproduces the main model's tokens); verification is unchanged."""

    def __init__(self, engine, k: int, cuda_graphs: bool, cuda_graph_batch_sizes: Sequence[int] | None,
                 progress: bool | None):
        model, runner = engine.model, engine.runner
        self.engine, self.model, self.runner, self.k = engine, model, runner, k
        main = runner.caches
        own = model.allocate_caches(engine.num_pages, engine.page_size, num_layers=1)  # the MTP layer's
        self.caches = KVCaches(main.layout, main.latent + own.latent, main.scale, main.index_layout,
                               None if main.index is None else main.index + own.index)
        self.target_fn = functools.partial(target_step, model)  # verify steps: logits at every token
        self.hidden_fn = model.hidden_states  # other steps: logits only where needed
        self.mtp_fn = functools.partial(mtp_step, model)
        if runner.compile_kwargs is not None:
            from ..compiler import compile as mlagraph_compile

            kw = dict(runner.compile_kwargs, attention_backend=model.backend.name)
            if isinstance(runner.step_fn, RegionalStep) and not runner.inductor_graphs:
                # the engine's own step with other heads: its layer graphs serve these steps too
                self.target_fn = runner.step_fn.with_head("target_head")
                self.hidden_fn = runner.step_fn.with_head("hidden_head")
            else:
                self.target_fn, self.hidden_fn = (mlagraph_compile(f, **kw) for f in (self.target_fn, self.hidden_fn))
            self.mtp_fn = mlagraph_compile(self.mtp_fn, **kw)  # one layer: compiled whole, flat in depth
            runner.compiled += [self.target_fn, self.hidden_fn, self.mtp_fn]
        self.draft_hook: Callable[[Request, list[int]], list[int]] | None = None
        self.verify_graphs = self.catchup_graphs = self.chain_graphs = None
        if cuda_graphs:
            self._capture(cuda_graph_batch_sizes, progress)

    # --- one engine step ------------------------------------------------------------------

    @torch.no_grad()
    def advance(self, step: list[tuple[Request, list[int]]]) -> list[tuple[Request, int]]:
        """Runs one scheduled step (see the module docstring); returns the (request, token)
        pairs emitted, in order. Finished requests have released their pages."""
        eng, k = self.engine, self.k
        t0 = time.perf_counter()
        entries = [(r, toks, r.num_cached) for r, toks in step]
        for r, toks, _ in entries:
            if r.decoding and len(toks) != k + 1:
                raise RuntimeError(f"speculative: request {r.id} decodes with {len(toks) - 1} drafts, expected {k}")
        logits, hidden = self._target(entries)
        emitted, catchup, row, lrow = [], [], 0, 0
        dec = [i for i, (r, _, _) in enumerate(entries) if r.decoding]
        if dec:
            acc, toks_out, logps = self._verify(entries, dec, logits)
        j_of = dict(zip(dec, range(len(dec))))
        for i, (r, toks, start) in enumerate(entries):
            rows = (row, row + len(toks))
            row += len(toks)
            if i in j_of:  # a verify step: keep acc drafts, then the target's token
                b = j_of[i]
                a = acc[b]
                lrow += k + 1
                r.num_cached = start + a + 1
                eng.stats.drafted_tokens += k
                eng.stats.accepted_tokens += a
                self._emit(r, toks_out[b][: a + 1], logps[b][: a + 1], emitted)
                r.draft, r.draft_probs = [], None
                if r.finish_reason is None:  # its accepted tokens and the target's, then filler
                    mtp_toks = r.tokens[start + 1 : start + a + 2]
                    catchup.append(((r, mtp_toks + [mtp_toks[-1]] * (k - a), start), rows, a))
                continue
            r.num_cached += len(toks)
            lrow += 1
            if r.num_cached == len(r.tokens):  # the prompt is done: its first token
                tok, logp = sample(logits[lrow - 1], r.params.temperature, eng.generator)
                self._emit(r, [tok], [logp], emitted)
            if r.finish_reason is None:
                catchup.append(((r, r.tokens[start + 1 : start + len(toks) + 1], start), rows,
                                len(toks) - 1 if r.decoding else None))
        if catchup:
            self._draft(catchup, hidden)
        for r, _, _ in entries:
            if r.finish_reason is None:  # the MTP rows of these pages are written now too
                eng.allocator.cache_full_pages(r.pages, r.tokens, r.num_cached, r.page_hashes)
            else:
                eng.scheduler.finish(r)
        self._time(entries, emitted, time.perf_counter() - t0)
        return emitted

    def _emit(self, r: Request, toks: list[int], logps: list[float], out: list) -> None:
        for tok, lp in zip(toks, logps):
            self.engine._append(r, tok, lp)
            out.append((r, tok))
            if r.finish_reason is not None:
                return

    def _time(self, entries, emitted, elapsed: float) -> None:
        s = self.engine.stats
        s.steps += 1
        if all(start >= r.prompt_len for r, _, start in entries):
            s.decode_tokens += len(emitted)  # generated tokens: what a decode step is for
            s.decode_seconds += elapsed
            s.decode_steps += 1
        else:
            s.prefill_tokens += sum(len(t) for _, t, _ in entries)
            s.prefill_seconds += elapsed

    # --- the three kinds of model call --------------------------------------------------------

    def _target(self, entries: list[Entry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states at every new token [T, D]; logits [R, V] at every token of a decoding
        request and at the last token of a prompt chunk, in entry order."""
        n_tok = sum(len(t) for _, t, _ in entries)
        g = self.verify_graphs
        if g is not None and all(r.decoding for r, _, _ in entries) and len(entries) <= g.max_batch:
            logits, hidden = g.run(*self._graph_args(entries))
            return logits, hidden
        batch = self._batch(entries)
        hidden = self.hidden_fn(batch, self.caches)[:n_tok]
        rows, at = [], 0
        for r, toks, _ in entries:
            rows += range(at, at + len(toks)) if r.decoding else [at + len(toks) - 1]
            at += len(toks)
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)]), hidden

    def _verify(self, entries, dec: list[int], logits: torch.Tensor):
        """Speculative sampling for the decoding entries: (accepted, tokens, logprobs) lists."""
        k, dev = self.k, logits.device
        starts, at = [], 0
        for r, toks, _ in entries:
            starts.append(at)
            at += k + 1 if r.decoding else 1
        idx = torch.tensor([starts[i] + o for i in dec for o in range(k + 1)], device=dev)
        target = logits[idx].view(len(dec), k + 1, -1)
        reqs = [entries[i][0] for i in dec]
        drafts = torch.tensor([r.draft for r in reqs], device=dev)
        probs = torch.stack([r.draft_probs for r in reqs])
        temps = torch.tensor([r.params.temperature for r in reqs], device=dev)
        accepted, tokens = verify(target, drafts, probs, temps, self.engine.generator)
        logp = torch.log_softmax(target.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]
        return accepted.tolist(), tokens.tolist(), logp.tolist()

    def _draft(self, catchup, hidden: torch.Tensor) -> None:
        """MTP catch-up over the rows the target made valid, then the chain: sets the drafts
        of every request that decodes next."""
        k, model = self.k, self.model
        entries = [e for e, _, _ in catchup]
        rows = torch.cat([torch.arange(a, b) for _, (a, b), _ in catchup]).to(hidden.device)
        out = self._mtp(entries, hidden[rows], self.catchup_graphs)
        at, pick = 0, []
        for (r, toks, _), _, d in catchup:
            if d is not None:
                pick.append(at + d)
            at += len(toks)
        reqs = [e[0] for (e, _, d) in catchup if d is not None]
        if not reqs:
            return
        temps = torch.tensor([r.params.temperature for r in reqs], device=hidden.device)
        h = out[torch.tensor(pick, device=out.device)]
        drafted, probs = [], []
        for i in range(k):
            if i:  # chain: the previous draft at the next position, fed the previous output
                chain = [(r, [t], r.num_cached + i - 1) for r, t in zip(reqs, drafted[-1].tolist())]
                h = self._mtp(chain, h, self.chain_graphs)
            tok, q = draft(model.logits(h), temps, self.engine.generator)
            drafted.append(tok)
            probs.append(q)
            if i == 0:
                for r in reqs:  # the chain's rows and the next verify step's
                    self.engine.scheduler.ensure_pages(r, r.num_cached + k + 1)
        tokens = torch.stack(drafted, 1).tolist()
        probs = torch.stack(probs, 1)  # [B, k, V]
        for b, r in enumerate(reqs):
            r.draft, r.draft_probs = tokens[b], probs[b]
            if self.draft_hook is not None:
                r.draft = [int(t) for t in self.draft_hook(r, list(r.draft))]
                if len(r.draft) != k:
                    raise ValueError(f"draft_hook: expected {k} draft tokens, got {r.draft!r}")
                r.draft_probs = torch.nn.functional.one_hot(torch.tensor(r.draft, device=probs.device),
                                                            probs.shape[-1]).float()

    def _mtp(self, entries: list[Entry], hidden: torch.Tensor, g) -> torch.Tensor:
        """The MTP layer over ``entries`` with their hidden rows [T, D] -> its output [T, D]."""
        n_tok = hidden.shape[0]
        uniform = all(len(t) == len(entries[0][1]) and s >= r.prompt_len for r, t, s in entries)
        if g is not None and uniform and len(entries) <= g.max_batch:
            g.hidden[:n_tok].copy_(hidden)
            return g.run(*self._graph_args(entries))
        batch = self._batch(entries)
        if batch.num_tokens > n_tok:  # padding requests: any hidden rows, never read
            hidden = torch.cat([hidden, hidden.new_zeros(batch.num_tokens - n_tok, hidden.shape[1])])
        return self.mtp_fn(batch, self.caches, hidden)[:n_tok]

    # --- batches and graphs -------------------------------------------------------------------

    def _batch(self, entries: list[Entry]):
        """An uncaptured batch: logits rows at every token (the callers pick theirs)."""
        e, cfg = self.engine, self.model.config
        return build_batch(
            self.model.backend.capabilities, [t for _, t, _ in entries], [s for _, _, s in entries],
            [r.pages for r, _, _ in entries], e.page_size, is_decode=[s >= r.prompt_len for r, _, s in entries],
            dsa=cfg.uses_dsa, dsa_dense_max_kv_len=e.dsa_dense_max_kv_len, all_logits=True,
            device=e.device,
        )

    def _graph_args(self, entries: list[Entry]):
        """(method, tokens, positions, slots, pages, seq_lens) of a uniform decode step, planned
        on the host before the replay by the function every step plans with (rule 7)."""
        ps, cfg = self.engine.page_size, self.model.config
        tokens, positions, slots, pages, seq_lens = [], [], [], [], []
        for r, toks, start in entries:
            tokens += toks
            for p in range(start, start + len(toks)):
                positions.append(p)
                slots.append(r.pages[p // ps] * ps + p % ps)
            pages.append(r.pages)
            seq_lens.append(start + len(toks))
        n = len(entries)
        _, method = plan_step(self.model.backend.capabilities, [len(entries[0][1])] * n, [s for _, _, s in entries],
                              [True] * n, dsa=cfg.uses_dsa, dsa_dense_max_kv_len=self.engine.dsa_dense_max_kv_len,
                              graphed=True)
        return method, tokens, positions, slots, pages, seq_lens

    def _capture(self, sizes, progress) -> None:
        """Verify, catch-up (k + 1 tokens per request) and chain (1 token) steps in CUDA graphs,
        one per bucket and forward method; the MTP graphs read their hidden rows from a
        static buffer the caller fills before each replay."""
        e, model, k = self.engine, self.model, self.k
        buckets = (graphs.default_buckets(e.max_num_seqs) if sizes is None
                   else graphs.check_buckets(sizes, e.max_num_seqs))
        caps, dsa = model.backend.capabilities, model.config.uses_dsa
        max_pages = max(math.ceil((e.max_model_len + k) / e.page_size), 1)

        def graphed(fn, q_len: int, with_hidden: bool):
            buf = None
            if with_hidden:
                buf = torch.zeros(buckets[-1] * q_len, model.config.hidden_size, dtype=model.dtype, device=e.device)
                step_fn = lambda b, c: fn(b, c, buf[: b.num_tokens])  # noqa: E731
            else:
                step_fn = fn
            g = graphs.DecodeGraphs(step_fn, self.caches, buckets, graphs.decode_plans(caps, dsa, q_len), max_pages,
                                    e.device, progress, q_len=q_len)
            g.hidden = buf
            return g

        self.verify_graphs = graphed(self.target_fn, k + 1, False)
        self.catchup_graphs = graphed(self.mtp_fn, k + 1, True)
        self.chain_graphs = graphed(self.mtp_fn, 1, True)
