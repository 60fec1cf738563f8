"""CUDA-graph decode: the decode step captured once per batch-size bucket, replayed every step.

Split the FlashInfer way into what is prepared once and what runs per step:

- :class:`StaticDecodeInputs` owns the device buffers of a decode batch, sized for the largest
  bucket, and one :class:`~mlagraph.model.batch.Batch` per (bucket, forward method) whose
  tensors are views into them. ``fill`` writes one step's metadata into pinned host mirrors and
  copies them to the device in one copy; padding rows (up to the bucket) are the padding
  requests of :func:`~mlagraph.model.batch.build_batch` (``PAD_TOKEN``, ``PAD_SLOT``, no pages).
- :class:`DecodeGraphs` captures ``step_fn(batch, caches)`` for each static batch into a
  ``torch.cuda.CUDAGraph`` (largest bucket first, one memory pool shared by all), and per step
  picks the bucket, fills the buffers and replays.

A batch of n decoding requests (one new token each) runs in the smallest bucket >= n; the plan
(dense or sparse for DSA models) is made on the host before the replay (docs/design.md rule 7), and
every plan variant a decode step can take has its own graph. Larger batches and any step
with prompt tokens run without graphs.

Speculative decoding's verify steps (s_q = k + 1 tokens per request) are captured the same
way with ``q_len=k + 1``: every request of a bucket brings q_len tokens, padding requests too.

Library kernels that plan on the host (FlashInfer) or keep per-step device metadata (FlashMLA's
scheduler) do so in a :class:`~mlagraph.ops.host_plan.Step` kept with each graph: its plans are
made during the warm-up, outside the capture, so the capture only launches kernels, and before
every replay ``Step.refresh`` re-plans them from the step's host metadata into the same buffers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from ..ops import host_plan

from ..model.batch import (
    PAD_SLOT, PAD_TOKEN, Batch, BatchKind, BatchPlan, ForwardMethod, NoForwardMethod, choose_forward_method,
    for_decode_graph,
)

_BATCH_TENSORS = ("input_ids", "positions", "slot_mapping", "req_ids", "block_table", "seq_lens", "cu_seqlens_q",
                  "cu_seqlens_k", "logits_indices")
_ALIGN = 16  # elements: every field starts 64-byte aligned (Inductor copies misaligned inputs)


def _round_up(n: int, m: int = _ALIGN) -> int:
    return -(-n // m) * m


def cache_tensors(caches) -> list[torch.Tensor]:
    """Every tensor of a model's caches, whose addresses the graphs bake in: an MLA model's
    KVCaches (latent, indexer keys, fp8 scale), or DeepSeek-V4's list of per-layer
    V4LayerCache (window, compressor states, compressed entries, indexer keys; None where a
    layer type has none)."""
    if isinstance(caches, (list, tuple)):
        return [t for c in caches for f in dataclasses.fields(c) if (t := getattr(c, f.name)) is not None]
    return [*caches.latent, *(caches.index or ()), *([caches.scale] if caches.scale is not None else [])]


def default_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes, b = {max_num_seqs}, 1
    while b < max_num_seqs:
        sizes.add(b)
        b *= 2
    return sorted(sizes)


def check_buckets(sizes, max_num_seqs: int) -> list[int]:
    """Validates user bucket sizes -> sorted, without repeats."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"Engine: cuda_graph_batch_sizes: expected a non-empty list of ints, got {sizes!r}")
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= max_num_seqs:
            raise ValueError(
                f"Engine: cuda_graph_batch_sizes: expected ints in [1, max_num_seqs={max_num_seqs}], got {list(sizes)}"
            )
    return sorted(set(sizes))


def decode_plans(caps, dsa: bool, q_len: int = 1) -> dict[ForwardMethod, BatchPlan]:
    """Every forward method a graph-captured decode step of ``q_len`` tokens per request
    (1, or k + 1 when verifying k drafts) can take on this backend,
    with the plan its graphs carry: each case a decode batch can be in (for DSA models every
    request dense, some, none) through the same :func:`~mlagraph.model.batch.for_decode_graph`
    and :func:`~mlagraph.model.batch.choose_forward_method` that pick a step's graph, so what is
    captured is exactly what replays."""
    cases = [(True, False), (False, True), (False, False)] if dsa else [(False, False)]
    kind = BatchKind.DECODE if q_len == 1 else BatchKind.MULTI_TOKEN_DECODE
    plans: dict[ForwardMethod, BatchPlan] = {}
    for dense, split in cases:
        plan = for_decode_graph(BatchPlan(kind, q_len, dsa, dsa_dense=dense, dsa_split=split))
        try:
            plans.setdefault(choose_forward_method(caps, plan), plan)
        except NoForwardMethod:
            continue
    return plans


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s memory that is not a view (no ``_base``).

    dynamo guards on the base of a view it is given. The graph-captured decode batch's tensors
    are slices of the static buffers, a prefill batch's are tensors of their own; a compiled
    region both run (the embedding, the head: regional steps share them across variants) would
    fail the base guard and compile again for the other kind. Same memory, same addresses for
    the graphs: only the view bookkeeping is dropped."""
    out = view.new_empty(0)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class StaticDecodeInputs:
    """Device buffers of a decode batch of ``q_len`` tokens per request (1; k + 1 to verify k
    drafts), for buckets up to ``max_bs`` requests (N = max_bs * q_len tokens).

    Device layout (each field 16-element aligned):
        int64 [3, S]: input_ids | positions | slot_mapping              (S = N rounded up)
        int32: seq_lens [R] | cu_seqlens_k [max_bs + 1, padded] | block_table [max_bs, max_pages]
               (R = max_bs rounded up)
        constant: req_ids [N] int32 (each request's index, q_len times), cu_seqlens_q
                  [max_bs + 1] int32 (multiples of q_len), logits_indices = arange [N] int64
    Both live in one byte buffer, filled through a pinned host mirror and copied in one copy.
    """

    def __init__(self, max_bs: int, max_pages: int, device: torch.device, q_len: int = 1):
        self.max_bs, self.max_pages, self.device = max_bs, max_pages, torch.device(device)
        self.q_len = q_len
        s, r = _round_up(max_bs * q_len), _round_up(max_bs)
        self._cu_k_at = r
        self._table_at = r + _round_up(max_bs + 1)
        n32 = self._table_at + max_bs * max_pages
        # One pinned host buffer and one device buffer, int64 fields then int32 ones: a step is
        # one copy (driver calls are the expensive part of a small step's host work).
        nbytes = 3 * s * 8 + n32 * 4
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._host64, self._host32 = self._split(self._host, s)
        self._dev64, self._dev32 = self._split(self._dev, s)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._np_table = self._np32[self._table_at :].reshape(max_bs, max_pages)
        self._rows: list[list[int]] = [[] for _ in range(max_bs)]  # pages now in each host table row
        self.req_ids = torch.arange(max_bs, dtype=torch.int32, device=self.device).repeat_interleave(q_len)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device) * q_len
        self.logits_indices = torch.arange(max_bs * q_len, dtype=torch.int64, device=self.device)
        self._np_table[:] = -1
        self._pad_positions = torch.arange(q_len).repeat(max_bs).numpy()
        self.fill([], [], [], [], [], bucket=max_bs)  # every row padding

    @staticmethod
    def _split(buf: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[: 3 * s * 8].view(torch.int64).view(3, s), buf[3 * s * 8 :].view(torch.int32)

    def batch(self, bucket: int, method: ForwardMethod, plan: BatchPlan) -> Batch:
        """The static batch of the first ``bucket`` requests: its tensors are views of the buffers."""
        t = bucket * self.q_len
        cu_k = self._dev32[self._cu_k_at : self._cu_k_at + bucket + 1]
        table = self._dev32[self._table_at : self._table_at + self.max_bs * self.max_pages].view(self.max_bs, -1)
        return Batch(
            plan=plan,
            method=method,
            num_kv_tokens=0,  # read only by MHA over a prefix, which decode graphs never run
            input_ids=_alias(self._dev64[0, :t]),
            positions=_alias(self._dev64[1, :t]),
            slot_mapping=_alias(self._dev64[2, :t]),
            req_ids=_alias(self.req_ids[:t]),
            block_table=_alias(table[:bucket]),
            seq_lens=_alias(self._dev32[:bucket]),
            cu_seqlens_q=_alias(self.cu_seqlens_q[: bucket + 1]),
            cu_seqlens_k=_alias(cu_k),
            logits_indices=_alias(self.logits_indices[:t]),
        )

    def fill(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             pages: Sequence[Sequence[int]], seq_lens: Sequence[int], *, bucket: int) -> None:
        """Writes one step (n real requests, rows n..bucket-1 padding) and copies it to the device.

        tokens, positions, slots: per token, q_len per request (host ints); seq_lens: per
        request; pages: each request's page ids. Block-table rows are rewritten only where they changed (a request's row usually
        only grows by a page now and then). The copy to the device is asynchronous from the
        host buffer: the caller reads each step's output (a sync) before the next fill, as the
        engine does.
        """
        n, q = len(seq_lens), self.q_len
        if not n <= bucket <= self.max_bs:
            raise ValueError(f"StaticDecodeInputs.fill: expected requests <= bucket <= {self.max_bs}, got {n}, {bucket}")
        if not len(tokens) == len(positions) == len(slots) == n * q:
            raise ValueError(f"StaticDecodeInputs.fill: expected {n * q} tokens, positions and slots ({q} per "
                             f"request), got {len(tokens)}, {len(positions)}, {len(slots)}")
        np64, np32 = self._np64, self._np32
        t, end = n * q, bucket * q
        # requests n.. are padding requests (batch.PAD_TOKEN): q tokens at positions 0..q-1,
        # written nowhere, on no pages, so keys of their own only (never read)
        np64[0, :t], np64[0, t:end] = tokens, PAD_TOKEN
        np64[1, :t], np64[1, t:end] = positions, self._pad_positions[: end - t]
        np64[2, :t], np64[2, t:end] = slots, PAD_SLOT
        np32[:n], np32[n:bucket] = seq_lens, q
        cu = self._cu_k_at
        np32[cu] = 0
        np32[cu + 1 : cu + bucket + 1] = np32[:bucket].cumsum()  # cu_seqlens_k of the lengths above
        for i in range(bucket):
            self._set_row(i, pages[i] if i < n else ())
        self._dev.copy_(self._host, non_blocking=True)

    def mirrors(self, batch: Batch) -> dict:
        """The static ``batch``'s metadata tensors -> their host values now (after ``fill``)."""
        b = batch.num_reqs
        host32 = self._host32
        table = host32[self._table_at : self._table_at + self.max_bs * self.max_pages].view(self.max_bs, -1)
        return {
            batch.seq_lens: host32[:b],
            batch.cu_seqlens_k: host32[self._cu_k_at : self._cu_k_at + b + 1],
            batch.block_table: table[:b],
            batch.cu_seqlens_q: torch.arange(b + 1, dtype=torch.int32) * self.q_len,
        }

    def _set_row(self, i: int, pages: Sequence[int]) -> None:
        old, k, n = self._rows[i], len(pages), len(self._rows[i])
        if k == n and (k == 0 or pages[-1] == old[-1]) and list(pages) == old:
            return  # unchanged: the common case (a changed row usually fails the cheap last-page test)
        if k > self.max_pages:
            raise ValueError(f"StaticDecodeInputs.fill: pages[{i}]: expected <= {self.max_pages} pages, got {k}")
        if k > n and list(pages[:n]) == old:  # the request grew: write only its new pages
            self._np_table[i, n:k] = pages[n:]
        else:
            self._np_table[i, :k] = pages
            if n > k:
                self._np_table[i, k:n] = -1
        self._rows[i] = list(pages)


def _compile_seconds(step_fn) -> float:
    """Time a compiled step has spent compiling so far (0 for an uncompiled one)."""
    return getattr(step_fn, "compile_seconds", 0.0)


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch
    logits: torch.Tensor  # [bucket, V]: the graph's output, rewritten by every replay
    step: host_plan.Step  # the library plans the graph reads, re-planned before each replay


class DecodeGraphs:
    """The decode step captured in CUDA graphs, one per (bucket, forward method).

    Args:
        step_fn: ``step_fn(batch, caches) -> logits [B, V]`` (the model, or its compiled form).
        caches: the engine's KVCaches (static: graphs bake in their addresses).
        buckets: batch sizes to capture, ascending.
        plans: forward method -> the BatchPlan its static batches carry (:func:`decode_plans`).
        max_pages: block-table width (pages of the longest request).
        q_len: tokens per request (1; k + 1 for speculative verify steps). ``step_fn`` may
            return a tensor or a tuple of tensors, one row per token.

    Attributes:
        capture_seconds: wall time of the capture (warm-up runs included), compiling excluded.
        compile_seconds: of that wall time, what compiling the step's graphs took.
    """

    desc = "capturing decode CUDA graphs"

    def __init__(self, step_fn, caches, buckets: Sequence[int], plans: dict[ForwardMethod, BatchPlan],
                 max_pages: int, device, progress: bool | None = None, q_len: int = 1):
        from tqdm.auto import tqdm

        self.buckets, self.methods = list(buckets), list(plans)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_pages, device, q_len)
        self._fn, self._caches = step_fn, caches
        self._setup()
        # Largest bucket first: the memory pool it leaves serves the smaller ones.
        todo = [(b, m) for m in plans for b in reversed(self.buckets)]
        disable = None if progress is None else not progress  # None: a bar only on a terminal
        start, compiled = time.perf_counter(), _compile_seconds(step_fn)
        with tqdm(total=len(todo), desc=self.desc, disable=disable) as bar:
            for b, m in todo:
                self._capture(b, m, self.inputs.batch(b, m, plans[m]))
                bar.update(1)
            # The first warm-up of each variant compiles its graphs: that time is compile time.
            self.compile_seconds = _compile_seconds(step_fn) - compiled
            self.capture_seconds = time.perf_counter() - start - self.compile_seconds
            bar.set_postfix_str(f"capture {self.capture_seconds:.1f}s, compile {self.compile_seconds:.1f}s")

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, method: ForwardMethod, tokens, positions, slots, pages, seq_lens) -> torch.Tensor:
        """One decode step of n <= max_batch requests -> logits [n * q_len, V], or the step
        function's tuple of such tensors (views of the graph's output: read them before the
        next step)."""
        n = len(seq_lens)
        bucket = self.bucket_for(n)
        self.inputs.fill(tokens, positions, slots, pages, seq_lens, bucket=bucket)
        out, rows = self._replay(bucket, method), n * self.inputs.q_len
        return tuple(o[:rows] for o in out) if isinstance(out, tuple) else out[:rows]

    # --- our capture: torch.cuda.graph, one pool -------------------------------------------------

    def _setup(self) -> None:
        self.graphs: dict[tuple[int, ForwardMethod], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _capture(self, bucket: int, method: ForwardMethod, batch: Batch) -> None:
        device = self.inputs.device
        # Warm up outside the graph (compiles the step, initialises cuBLAS and Triton), on a
        # side stream as capture requires; the buffers hold padding only: nothing is written.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        step = host_plan.Step(self.inputs.mirrors(batch))  # plans made in the warm-up, reused by the capture
        with torch.cuda.stream(side), torch.no_grad(), host_plan.step(step):
            for _ in range(2):
                self._fn(batch, self._caches)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad(), host_plan.step(step):
            logits = self._fn(batch, self._caches)
        self.graphs[(bucket, method)] = _Captured(graph, batch, logits, step)

    def _replay(self, bucket: int, method: ForwardMethod) -> torch.Tensor:
        captured = self.graphs[(bucket, method)]
        if captured.step.num_plans:  # re-plan from this step's metadata, into the graph's buffers
            captured.step.refresh(self.inputs.mirrors(captured.batch))
        captured.graph.replay()
        return captured.logits


class InductorDecodeGraphs(DecodeGraphs):
    """Decode graphs captured by Inductor's CUDA-graph trees (``mode="reduce-overhead"``).

    The engine keeps the bucketing and the static buffers: every bucket's inputs (and the
    caches) are marked static, so the trees record one graph per (bucket, method) here, at
    construction, and replay it without copying inputs. ``step_fn`` is the step compiled with
    that mode; prefill runs through a separately compiled function without graphs.
    """

    desc = "recording decode CUDA graphs (Inductor)"

    def _setup(self) -> None:
        for t in cache_tensors(self._caches):
            torch._dynamo.mark_static_address(t, guard=False)
        self.batches: dict[tuple[int, ForwardMethod], Batch] = {}

    def _capture(self, bucket: int, method: ForwardMethod, batch: Batch) -> None:
        for name in _BATCH_TENSORS:
            torch._dynamo.mark_static_address(getattr(batch, name), guard=False)
        self.batches[(bucket, method)] = batch
        for _ in range(3):  # warm-up run, recording run, first replay
            self._replay(bucket, method)

    def _replay(self, bucket: int, method: ForwardMethod) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
        batch = self.batches[(bucket, method)]
        # Inductor's trees call the ops only while recording; a library's per-step plans cannot
        # be refreshed between its replays, so those backends use our own capture (DecodeGraphs).
        with torch.no_grad(), host_plan.step(self.inputs.mirrors(batch)):
            return self._fn(batch, self._caches)
