"""Batch metadata, the host-side batch plan, and the forward-method dispatch.

The engine describes each step's batch with CPU-side facts only (how many new tokens each
request brings, how many it already has in the cache, whether it is decoding). From those,
once per batch and without reading any device tensor:

- :func:`plan_batch` classifies the batch (:class:`BatchKind`) into a small frozen
  :class:`BatchPlan`;
- :func:`choose_forward_method` picks the attention method every layer runs — a pure function
  of (backend capabilities, plan), pinned by a hermetic test over the whole matrix;
- :func:`build_batch` materialises the device tensors (:class:`Batch`) the ops read.

Nothing here reads an environment variable or a platform flag (docs/design.md rule 1).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Sequence

import torch

from ..ops.backends import Capabilities

# A decode step brings at most this many new tokens per request (1, or a few when verifying
# speculated tokens). Longer runs are prefill chunks.
MAX_DECODE_Q_LEN = 8


class BatchKind(enum.Enum):
    PREFILL = "prefill"  # every request starts from an empty cache
    CHUNKED_PREFILL = "chunked_prefill"  # prompt chunks, some over a cached prefix
    DECODE = "decode"  # every request decodes one token
    MULTI_TOKEN_DECODE = "multi_token_decode"  # every request decodes s_q > 1 tokens (verify)
    MIXED = "mixed"  # decoding requests and prompt chunks together


class ForwardMethod(enum.Enum):
    MHA = "mha"  # dense MHA prefill over the new tokens (no prefix)
    MHA_PREFIX = "mha_prefix"  # MHA over the cached prefix fetched back + the new tokens
    ABSORBED = "absorbed"  # absorbed MLA over the paged latent cache (decode)
    SPARSE = "sparse"  # DSA: indexer top-k, then sparse MLA over the paged latent cache
    DSA_SPLIT = "dsa_split"  # DSA, mixed: MHA over the prefix for short requests, sparse for long


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The only host-side facts that choose a code path. Hashable; small; made once per batch.

    ``decode_q_len`` is the uniform number of new tokens per request for decode kinds (else 0).
    ``dsa`` says the model runs DeepSeek Sparse Attention (V3.2); ``dsa_dense`` that this batch
    may run dense attention instead: every request's kv length (cached + new tokens) is at most
    the dense limit (index_topk by default, where top-k keeps every key: dense == sparse exactly);
    ``dsa_split`` that some requests fit and some do not (each runs its own path).
    """

    kind: BatchKind
    decode_q_len: int
    dsa: bool
    dsa_dense: bool = False  # DSA model, and every request's kv length fits the dense limit
    dsa_split: bool = False  # DSA model, and some requests fit the dense limit, some do not


class NoForwardMethod(ValueError):
    """The backend's capabilities offer no way to run this batch."""


def fits_dense(kv_len: int, dsa_dense_max_kv_len: int) -> bool:
    """The DSA rule, in its one home: a request whose kv length (cached + new tokens) is at most
    the dense limit runs dense attention (exact when the limit is index_topk: its top-k would
    keep every key)."""
    return kv_len <= dsa_dense_max_kv_len


def plan_batch(
    q_lens: Sequence[int], prefix_lens: Sequence[int], is_decode: Sequence[bool], *, dsa: bool,
    dsa_dense_max_kv_len: int = 0,
) -> BatchPlan:
    """Classifies one batch from CPU metadata: per request, new tokens, cached tokens, decoding?

    For DSA models, ``dsa_dense_max_kv_len`` (the engine passes index_topk unless told
    otherwise) makes the batch dense when every request :func:`fits_dense`, and split when
    only some do: short requests dense, long ones sparse.
    """
    if not (len(q_lens) == len(prefix_lens) == len(is_decode)) or not q_lens:
        raise ValueError(
            f"plan_batch: expected equal, non-empty per-request lists, got {len(q_lens)}, "
            f"{len(prefix_lens)}, {len(is_decode)}"
        )
    # Builtins over the lists only (min/max/map/all/any run in C): this runs once per engine
    # step on the host and must stay negligible (benchmarks/planner.py, < 20 µs at 256).
    q_min, q_max = min(q_lens), max(q_lens)
    if q_min < 1:
        raise ValueError(f"plan_batch: q_lens: expected every request to bring >= 1 token, got {list(q_lens)}")
    kv_lens = list(map(operator.add, prefix_lens, q_lens))
    # every request fits (the longest does) / some do (the shortest does)
    dense = dsa and fits_dense(max(kv_lens), dsa_dense_max_kv_len)
    split = dsa and not dense and fits_dense(min(kv_lens), dsa_dense_max_kv_len)
    if all(is_decode):
        if q_min != q_max or q_max > MAX_DECODE_Q_LEN:
            raise ValueError(
                f"plan_batch: decode q_lens: expected one length <= {MAX_DECODE_Q_LEN} for all requests, "
                f"got {list(q_lens)}"
            )
        kind = BatchKind.DECODE if q_max == 1 else BatchKind.MULTI_TOKEN_DECODE
        return BatchPlan(kind, q_max, dsa, dense, split)
    if any(is_decode):
        return BatchPlan(BatchKind.MIXED, 0, dsa, dense, split)
    if max(prefix_lens) > 0:
        return BatchPlan(BatchKind.CHUNKED_PREFILL, 0, dsa, dense, split)
    return BatchPlan(BatchKind.PREFILL, 0, dsa, dense, split)


def for_decode_graph(plan: BatchPlan) -> BatchPlan:
    """The plan a CUDA-graph-captured decode step runs instead of ``plan``: a DSA batch with
    short and long requests runs sparse (exact for the short ones too), since the split
    method's group sizes are not static."""
    return dataclasses.replace(plan, dsa_split=False) if plan.dsa_split else plan


def plan_step(
    caps: Capabilities, q_lens: Sequence[int], prefix_lens: Sequence[int], is_decode: Sequence[bool], *,
    dsa: bool, dsa_dense_max_kv_len: int = 0, graphed: bool = False,
) -> tuple[BatchPlan, ForwardMethod]:
    """The one decision of a step's code path: its plan and forward method.

    :func:`build_batch`, the engine's CUDA-graph decode and the capture of those graphs
    (:func:`mlagraph.engine.cuda_graphs.decode_plans`) all decide through here. ``graphed``: the
    step replays a captured decode graph (:func:`for_decode_graph`).
    """
    plan = plan_batch(q_lens, prefix_lens, is_decode, dsa=dsa, dsa_dense_max_kv_len=dsa_dense_max_kv_len)
    if graphed:
        plan = for_decode_graph(plan)
    return plan, choose_forward_method(caps, plan)


def choose_forward_method(caps: Capabilities, plan: BatchPlan) -> ForwardMethod:
    """The attention method for every layer of this batch. Pure: capabilities x plan only."""
    if plan.dsa:
        if plan.dsa_dense:
            try:  # every key fits in index_topk: the dense method for this kind, if the backend has it
                return choose_forward_method(caps, dataclasses.replace(plan, dsa=False, dsa_dense=False))
            except NoForwardMethod:
                if not caps.sparse_mla:
                    raise
                return ForwardMethod.SPARSE  # exact too, only slower
        if not caps.sparse_mla:
            raise NoForwardMethod("backend has no sparse_mla, which DSA models (V3.2) need")
        if plan.dsa_split and caps.mha_over_prefix:
            return ForwardMethod.DSA_SPLIT
        return ForwardMethod.SPARSE  # exact for the short requests too
    if plan.kind is BatchKind.DECODE:
        return ForwardMethod.ABSORBED
    if plan.kind is BatchKind.MULTI_TOKEN_DECODE:
        if caps.multi_token_decode:
            return ForwardMethod.ABSORBED
        if caps.mha_over_prefix:
            return ForwardMethod.MHA_PREFIX
        raise NoForwardMethod("backend has neither multi-token decode nor MHA over a prefix")
    if plan.kind is BatchKind.PREFILL:
        if caps.mha_prefill:
            return ForwardMethod.MHA
        raise NoForwardMethod("backend has no dense MHA prefill")
    # CHUNKED_PREFILL and MIXED: queries over a cached prefix with ragged lengths.
    if caps.mha_over_prefix:
        return ForwardMethod.MHA_PREFIX
    raise NoForwardMethod(f"backend has no MHA over a cached prefix, which {plan.kind.value} batches need")


# A padding request (batches padded to ``min_reqs`` requests, CUDA-graph buckets): its q_len
# tokens are PAD_TOKEN at positions 0.. over no cached prefix, on no pages, written nowhere
# (slot PAD_SLOT); so its kv length is its q_len and attention reads only its own new keys.
PAD_TOKEN = 0
PAD_SLOT = -1


@dataclasses.dataclass
class DsaSplit:
    """Sub-batch metadata of a DSA_SPLIT batch (Td dense tokens of Bd requests, Ts sparse).

    dense_rows: [Td] int64 token rows of the dense requests; sparse_rows: [Ts] int64 the rest.
    dense_block_table: [Bd, P] int32; dense_cu_seqlens_q / _k: [Bd+1] int32;
    dense_num_kv_tokens: host int, sum of the dense requests' kv lengths.
    """

    dense_rows: torch.Tensor
    sparse_rows: torch.Tensor
    dense_block_table: torch.Tensor
    dense_cu_seqlens_q: torch.Tensor
    dense_cu_seqlens_k: torch.Tensor
    dense_num_kv_tokens: int


@dataclasses.dataclass
class Batch:
    """One step's inputs. Host ints first, then device tensors (T tokens, B requests, P pages).

    Attributes:
        plan, method: the host-side plan and the attention method chosen from it.
        num_kv_tokens: sum of seq_lens (host int; the size of a fetched prefix read).
        input_ids: [T] int64.  positions: [T] int64, position of each token in its request.
        slot_mapping: [T] int64 cache slot of each new token (-1: padding, not written).
        req_ids: [T] int32, the request (row of block_table) of each token.
        block_table: [B, P] int32 page ids, -1 past the end.
        seq_lens: [B] int32, cached + new tokens of each request after this step.
        cu_seqlens_q: [B+1] int32 new tokens.  cu_seqlens_k: [B+1] int32 seq_lens.
        logits_indices: [N] int64 rows of the hidden states to turn into logits.
        single_request: (host) the step is one request's prefill with no cached prefix, left
            unpadded for a backend with ``dense_prefill_sdpa`` (whose prefill sees from the
            shapes alone that queries and keys are the same T tokens of one request and runs a
            dense kernel). A graph variant of its own: a 1-request batch is special to dynamo.
    """

    plan: BatchPlan
    method: ForwardMethod
    num_kv_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    req_ids: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    logits_indices: torch.Tensor
    split: DsaSplit | None = None  # DSA_SPLIT batches only
    single_request: bool = False
    # device metadata tensor -> its host copy, for the kernels' per-step plans (ops/host_plan.py);
    # never read inside the step, so not part of any graph
    mirrors: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def variant(self) -> tuple[BatchPlan, ForwardMethod, bool]:
        """The host facts that select the step's code path (so its compiled graph): sizes vary
        within a variant, nothing else does."""
        return self.plan, self.method, self.single_request

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.block_table.shape[0]


def build_batch(
    caps: Capabilities,
    token_ids: Sequence[Sequence[int]],
    prefix_lens: Sequence[int],
    pages: Sequence[Sequence[int]],
    page_size: int,
    *,
    is_decode: Sequence[bool] | None = None,
    dsa: bool = False,
    dsa_dense_max_kv_len: int = 0,
    all_logits: bool = False,
    min_reqs: int = 1,
    device: torch.device | str = "cpu",
) -> Batch:
    """Builds a batch from per-request new tokens, cached-prefix lengths and page lists.

    ``token_ids[b]`` are request b's new tokens, at positions prefix_lens[b].. ; ``pages[b]``
    its pages, enough for all of them. Logits are taken at each request's last new token, or
    at every token with ``all_logits``.

    ``min_reqs`` pads the batch with empty requests (no pages, slot -1: nothing is read or
    written for them, their logits rows come last and are to be ignored) and the block table
    to at least 2 columns (and, in a DSA split batch, each of its dense and sparse groups to
    ``min_reqs`` requests). Engines pass 1 (no padding): compiled graphs trace sizes
    size-oblivious, so a size of 1 reuses them; padding is for callers that want a fixed floor.
    """
    n = len(token_ids)
    is_decode = list(is_decode) if is_decode is not None else [False] * n
    # The plan comes from the real requests: padding never changes it (a padding request is
    # short enough for dense DSA, and must not turn an all-sparse batch into a split one).
    plan, method = plan_step(caps, [len(t) for t in token_ids], prefix_lens, is_decode, dsa=dsa,
                             dsa_dense_max_kv_len=dsa_dense_max_kv_len)
    # Padding requests to add: enough for min_reqs in all, and in a DSA split batch for
    # min_reqs in each of its dense and sparse groups (each group's size is a graph dimension);
    # otherwise padding runs with the one group there is.
    fits = [dsa and fits_dense(p + len(t), dsa_dense_max_kv_len) for p, t in zip(prefix_lens, token_ids)]
    n_dense = sum(fits)
    mixed = 0 < n_dense < n
    pad_dense = max(0, min_reqs - n_dense) if mixed else max(0, min_reqs - n)
    pad_sparse = max(0, min_reqs - (n - n_dense)) if mixed else 0
    # One request's prefill over no prefix, on a backend with a dense kernel for exactly that:
    # not padded, so it can take the dense kernel (its own graph variant when compiled).
    single = (caps.dense_prefill_sdpa and n == 1 and not is_decode[0] and prefix_lens[0] == 0
              and (not dsa or fits[0]))
    n_pad = 0 if single else pad_dense + pad_sparse
    if n_pad:
        pad_len = len(token_ids[0]) if n and all(is_decode) else 1
        token_ids = list(token_ids) + [[PAD_TOKEN] * pad_len] * n_pad
        prefix_lens = list(prefix_lens) + [0] * n_pad
        pages = list(pages) + [[]] * n_pad
        is_decode = is_decode + [all(is_decode)] * n_pad
    # per request, dense in a split batch; padding runs with the group it pads
    dense = fits + ([True] * pad_dense + [False] * pad_sparse if mixed else [n_dense == n] * n_pad)
    q_lens = [len(t) for t in token_ids]

    input_ids, positions, slots, req_ids, seq_lens = [], [], [], [], []
    for b, (toks, prefix, pg) in enumerate(zip(token_ids, prefix_lens, pages)):
        total = prefix + len(toks)
        padding = b >= n
        if not padding and len(pg) * page_size < total:
            raise ValueError(f"build_batch: request {b} needs {total} slots, has {len(pg)} pages of {page_size}")
        input_ids += list(toks)
        positions += range(prefix, total)
        if padding:
            slots += [PAD_SLOT] * len(toks)
        else:
            slots += [pg[p // page_size] * page_size + p % page_size for p in range(prefix, total)]
        req_ids += [b] * len(toks)
        seq_lens.append(total)
    width = max(min_reqs, 1, max(len(p) for p in pages))
    table = [list(p) + [-1] * (width - len(p)) for p in pages]
    cu_q = [0]
    for q in q_lens:
        cu_q.append(cu_q[-1] + q)
    cu_k = [0]
    for s in seq_lens:
        cu_k.append(cu_k[-1] + s)
    logits_rows = list(range(cu_q[-1])) if all_logits else [c - 1 for c in cu_q[1:]]

    mirrors = {}

    def t(x, dtype):
        host = torch.tensor(x, dtype=dtype)
        dev = host.to(device)
        mirrors[dev] = host  # the host values, for library plans made once per step
        return dev

    split = None
    if method is ForwardMethod.DSA_SPLIT:
        rows = [list(range(cu_q[b], cu_q[b + 1])) for b in range(len(seq_lens))]
        d_q, d_k = [0], [0]
        for b in (b for b in range(len(seq_lens)) if dense[b]):
            d_q.append(d_q[-1] + q_lens[b])
            d_k.append(d_k[-1] + seq_lens[b])
        split = DsaSplit(
            dense_rows=t([r for b, rs in enumerate(rows) if dense[b] for r in rs], torch.int64),
            sparse_rows=t([r for b, rs in enumerate(rows) if not dense[b] for r in rs], torch.int64),
            dense_block_table=t([row for b, row in enumerate(table) if dense[b]], torch.int32),
            dense_cu_seqlens_q=t(d_q, torch.int32),
            dense_cu_seqlens_k=t(d_k, torch.int32),
            dense_num_kv_tokens=d_k[-1],
        )

    return Batch(
        plan=plan,
        method=method,
        num_kv_tokens=cu_k[-1],
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64),
        req_ids=t(req_ids, torch.int32),
        block_table=t(table, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        cu_seqlens_q=t(cu_q, torch.int32),
        cu_seqlens_k=t(cu_k, torch.int32),
        logits_indices=t(logits_rows, torch.int64),
        split=split,
        single_request=single and method is ForwardMethod.MHA,
        mirrors=mirrors,
    )
