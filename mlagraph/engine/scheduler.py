"""Which requests run in the next step, with which tokens, in which pages.

Requests wait in arrival order and are admitted while fewer than ``max_num_seqs`` run and the
free pages cover what every running request may still need (prompt + max_new_tokens, capped
at max_model_len): once admitted, a request never waits for a page. With prefix caching, a
request starts from the longest run of cached full pages matching its prompt (always leaving
its last prompt token to compute: its logits give the first generated token).

Each step every decoding request brings its one new token and prompt chunks fill the rest of
the token budget (``prefill_chunk_size``; unlimited when None).

With speculative decoding (``speculative_tokens`` k > 0) a decoding request brings its new
token and its k draft tokens (``req.draft``), and its pages are assured for k more tokens:
a verify step writes k positions past what the request may end with.
"""

from __future__ import annotations

import collections
import math

from .block_manager import BlockManager
from .request import Request

Step = list[tuple[Request, list[int]]]  # (request, its new tokens this step)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_model_len: int,
                 prefill_chunk_size: int | None, speculative_tokens: int = 0):
        self.blocks = block_manager
        self.speculative_tokens = speculative_tokens
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.blocks.page_size)

    def _max_pages(self, req: Request) -> int:
        """Pages the request holds when it ends at the latest."""
        end = min(req.prompt_len + req.params.max_new_tokens, self.max_model_len) + self.speculative_tokens
        return self.pages_for(end)

    def admit(self, req: Request, *, reuse_prefix: bool = True) -> bool:
        """Takes ``req`` into the running set if its pages are assured (matching its prefix
        first); False, with nothing changed, if not."""
        reserved = sum(self._max_pages(r) - len(r.pages) for r in self.running)
        pages, hashes = [], []
        if reuse_prefix:
            pages, hashes = self.blocks.match_prefix(req.tokens, max_pages=(req.prompt_len - 1) // self.blocks.page_size)
        if self._max_pages(req) - len(pages) + reserved > self.blocks.num_free:
            self.blocks.free(pages)
            return False
        req.pages, req.page_hashes = pages, hashes
        req.num_cached = req.num_cached_prompt_tokens = len(pages) * self.blocks.page_size
        self.running.append(req)
        return True

    def schedule(self) -> Step:
        """Admits what fits, then plans and allocates the next step (empty: nothing to run)."""
        while self.waiting and len(self.running) < self.max_num_seqs and self.admit(self.waiting[0]):
            self.waiting.popleft()
        if not self.running and self.waiting:  # the engine checks num_pages against max_model_len
            raise RuntimeError(f"scheduler: request {self.waiting[0].id} cannot be admitted into an empty cache")
        return self.plan(self.running, self.prefill_chunk_size)

    def plan(self, reqs: list[Request], chunk_size: int | None) -> Step:
        """Every decoding request's new token (and draft), then prompt chunks within the token
        budget; the pages the step writes are allocated."""
        budget = chunk_size or math.inf
        step: Step = [(r, r.tokens[r.num_cached :] + r.draft) for r in reqs if r.decoding]
        budget -= sum(len(t) for _, t in step)
        for r in reqs:
            if r.decoding:
                continue
            take = min(r.prompt_len - r.num_cached, max(budget, 0))
            if take <= 0 and step:
                continue
            take = max(take, 1)
            step.append((r, r.tokens[r.num_cached : r.num_cached + take]))
            budget -= take
        for r, toks in step:
            self.ensure_pages(r, r.num_cached + len(toks))
        return step

    def advance(self, step: Step, cache_pages: bool = True) -> list[Request]:
        """After a step ran: its tokens are cached (full pages become findable unless
        ``cache_pages`` is False); returns the requests that reached the end of their known
        tokens (they sample next)."""
        ready = []
        for r, toks in step:
            r.num_cached += len(toks)
            if cache_pages:
                self.blocks.cache_full_pages(r.pages, r.tokens, r.num_cached, r.page_hashes)
            if r.num_cached == len(r.tokens):
                ready.append(r)
        return ready

    def ensure_pages(self, req: Request, num_tokens: int) -> None:
        """Allocates pages until ``req`` holds slots for ``num_tokens`` tokens (within what its
        admission assured)."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need > 0:
            req.pages += self.blocks.allocate(need)

    def finish(self, req: Request) -> None:
        """Takes a finished (or abandoned) request out and releases its pages."""
        if req in self.running:
            self.running.remove(req)
        self.blocks.free(req.pages)
        req.pages = []

    def abort_all(self) -> list[Request]:
        """Drops every waiting and running request (after an error): no page stays held."""
        dropped = list(self.running) + list(self.waiting)
        for r in list(self.running):
            self.finish(r)
        self.waiting.clear()
        return dropped
