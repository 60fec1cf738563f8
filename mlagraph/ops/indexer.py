"""DSA lightning indexer (DeepSeek V3.2): the indexer-key cache write and the top-k selection.

Each query token scores every key its request has cached so far,

    score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])        for s <= positions[t],

and keeps the positions of the ``topk`` best keys; sparse MLA then attends to only those. The
caller folds the softmax scale (``D**-0.5``) and ``Hi**-0.5`` into ``weights``: both are positive,
so ``relu(x * c) == c * relu(x)`` and the ranking is the one transformers' ``DeepseekV32Indexer``
computes.

The key cache layouts ("bf16": model-dtype rows, "fp8": e4m3 values + one float32 scale) are
defined in :mod:`.layouts`; this file only moves rows in and out through its helpers.
"""

from __future__ import annotations

import torch

from . import layouts
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_positive, check_tensor, fail
from ._define import custom_op


def _check_cache(op: str, k_cache: torch.Tensor, layout: str, head_dim: object, device: torch.device) -> None:
    check_choice(op, "layout", layout, layouts.INDEXER_LAYOUTS)
    width = layouts.indexer_row_width(layout, head_dim)
    dtypes = FLOAT_DTYPES if layout == "bf16" else (torch.uint8,)
    check_tensor(op, "k_cache", k_cache, shape=(None, None, width), dtypes=dtypes, device=device)


# ---------------------------------------------------------------------------------------------
# indexer_cache_write


def _check_indexer_cache_write(k, k_cache, slot_mapping, layout) -> None:
    op = "indexer_cache_write"
    check_tensor(op, "k", k, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, head_dim = k.shape
    _check_cache(op, k_cache, layout, head_dim, k.device)
    # Written in place through a flat [slots, width] view, which needs collapsible page dims.
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        want = "pages stored back to back (stride(0) == page_size * stride(1))"
        fail(op, "k_cache", want, f"strides {k_cache.stride()}")
    check_tensor(op, "slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=k.device)


@custom_op("mlagraph::indexer_cache_write", mutates_args=("k_cache",))
def indexer_cache_write(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str
) -> None:
    """Writes each token's indexer key into its cache slot.

    Args:
        k: [T, D] float32/bfloat16/float16, the indexer keys (already rotated).
        k_cache: [num_pages, page_size, W] written in place; W and dtype from ``layout``:
            "bf16" -> W = D in the model dtype (bf16/fp16/fp32); "fp8" -> W = D + 4, uint8.
        slot_mapping: [T] int32/int64, flat slot ``page * page_size + offset``; -1 is skipped.
        layout: "bf16" or "fp8".
    """
    _check_indexer_cache_write(k, k_cache, slot_mapping, layout)
    rows = layouts.quantize_index_keys(layout, k, k_cache.dtype)
    layouts.scatter_rows(k_cache, slot_mapping, rows)


@indexer_cache_write.register_fake
def indexer_cache_write_fake(k, k_cache, slot_mapping, layout):
    _check_indexer_cache_write(k, k_cache, slot_mapping, layout)


# ---------------------------------------------------------------------------------------------
# indexer_topk


def _check_indexer_topk(q, weights, k_cache, req_ids, positions, block_table, layout, topk) -> None:
    op = "indexer_topk"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    dev = q.device
    check_tensor(op, "weights", weights, shape=(num_tokens, num_heads), dtypes=(torch.float32,), device=dev)
    _check_cache(op, k_cache, layout, head_dim, dev)
    check_tensor(op, "req_ids", req_ids, shape=(num_tokens,), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    if not isinstance(topk, (int, torch.SymInt)) or isinstance(topk, bool):
        fail(op, "topk", "an int", type(topk).__name__)
    check_positive(op, "topk", topk)


@custom_op("mlagraph::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    layout: str,
    topk: int,
) -> torch.Tensor:
    """Positions of the ``topk`` best-scoring visible keys of each query token.

    Args:
        q: [T, Hi, D] float32/bfloat16/float16, indexer queries (already rotated).
        weights: [T, Hi] float32, per-head weights with the softmax scale and Hi**-0.5 folded in.
        k_cache: [num_pages, page_size, W] indexer key cache in ``layout`` (see
            :func:`indexer_cache_write`).
        req_ids: [T] int32, the row of ``block_table`` each token belongs to.
        positions: [T] int32/int64, absolute position of each token in its request; it sees the
            keys at positions 0..positions[t] (its own key must already be in the cache).
        block_table: [B, P] int32, page ids of each request (-1 = no page; keys there are
            never picked).
        layout: "bf16" or "fp8".
        topk: number of keys to keep (2048 for DeepSeek V3.2).

    Returns:
        [T, topk] int32 key positions, ordered by descending score; when fewer than ``topk``
        keys are visible, all of them come first and the rest is -1.
    """
    _check_indexer_topk(q, weights, k_cache, req_ids, positions, block_table, layout, topk)
    num_tokens = q.shape[0]
    page_size, width = k_cache.shape[1], k_cache.shape[2]
    max_len = block_table.shape[1] * page_size

    # Each token gathers its request's S = P * page_size keys: T * S * D floats, simple rather than
    # lean (kernels stream the pages instead).
    slots = layouts.slots_from_block_table(block_table, page_size, max_len)[req_ids.long()]  # [T, S]
    rows = k_cache.reshape(-1, width)[slots.clamp_min(0)]  # [T, S, W]; -1 slots are masked below
    keys = layouts.dequantize_index_keys(layout, rows, torch.float32)  # [T, S, D]

    logits = torch.relu(torch.matmul(q.float(), keys.transpose(1, 2)))  # [T, Hi, S]
    scores = torch.matmul(weights.unsqueeze(1), logits).squeeze(1)  # [T, S]
    pos = torch.arange(max_len, device=q.device)
    visible = (pos[None, :] <= positions.long()[:, None]) & (slots >= 0)
    scores = scores.masked_fill(~visible, float("-inf"))

    # topk columns of -inf let topk > S work without a shape branch; -inf picks become -1.
    padded = torch.cat([scores, scores.new_full((num_tokens, topk), float("-inf"))], dim=1)
    best, idx = padded.topk(topk, dim=1)
    return torch.where(best > float("-inf"), idx, torch.full_like(idx, -1)).to(torch.int32)


@indexer_topk.register_fake
def indexer_topk_fake(q, weights, k_cache, req_ids, positions, block_table, layout, topk):
    _check_indexer_topk(q, weights, k_cache, req_ids, positions, block_table, layout, topk)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)
