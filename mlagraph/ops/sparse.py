"""DSA sparse MLA (DeepSeek V3.2): absorbed MLA over only the keys the indexer selected.

The scoring is exactly :mod:`.decode`'s (and shares its code): per head,
``softmax_scale * (q_nope . kv_c + q_pe . k_pe)`` over the selected latents, which are both key and
value. Given every visible position, in order, it computes the same numbers as ``mla_decode``
with s_q = 1, which is what lets a planner run dense attention exactly when a request has no
more keys than index_topk.
"""

from __future__ import annotations

import torch

from . import layouts
from ._checks import FLOAT_DTYPES, check_positive, check_same_dtype, check_tensor
from ._define import custom_op
from .decode import check_latent_cache, gather_latent, latent_attention


def _check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale):
    op = "sparse_mla"
    check_tensor(op, "q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, kv_lora_rank = q_nope.shape
    dev = q_nope.device
    check_tensor(op, "q_pe", q_pe, shape=(num_tokens, num_heads, None), device=dev)
    check_same_dtype(op, "q_pe", q_pe, "q_nope", q_nope)
    check_latent_cache(op, kv_cache, scale, layout, kv_lora_rank, q_pe.shape[2], dev)
    check_tensor(op, "topk_indices", topk_indices, shape=(num_tokens, None), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "req_ids", req_ids, shape=(num_tokens,), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_positive(op, "softmax_scale", softmax_scale)


@custom_op("mlagraph::sparse_mla", mutates_args=())
def sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA of each token over the cached keys at its ``topk_indices``.

    Args:
        q_nope: [T, H, L] float32/bfloat16/float16, queries with W_UK absorbed.
        q_pe: [T, H, R], same dtype, the rotated rope part of the queries.
        kv_cache: [num_pages, page_size, W] latent cache in ``layout`` (as in ``mla_decode``).
        topk_indices: [T, K] int32 key POSITIONS within the token's request (as returned by
            ``indexer_topk``, which already applied causality); -1 = no key. Positions past the
            block table are ignored like -1. Duplicates are the caller's bug: such a key would
            count twice. Nothing here checks them (that would read data).
        req_ids: [T] int32, the row of ``block_table`` each token belongs to.
        block_table: [B, P] int32 page ids of each request (-1 = no page, ignored like -1).
        scale: [1] float32 per-tensor scale, required for "fp8", ignored otherwise.
        layout: "bf16", "fp8" or "fp8_ds".
        softmax_scale: > 0, multiplies q.k.

    Returns:
        out: [T, H, L] in q's dtype; lse: [T, H] float32 natural-log log-sum-exp of the scaled
        scores. A token with no selected key gets out 0 and lse -inf.
    """
    _check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale)
    page_size = kv_cache.shape[1]
    max_len = block_table.shape[1] * page_size
    pos = topk_indices.long()
    in_table = (pos >= 0) & (pos < max_len)
    table_slots = layouts.slots_from_block_table(block_table, page_size, max_len)  # [B, max_len]
    slots = table_slots[req_ids.long()[:, None], pos.clamp(0, max_len - 1)]  # [T, K]
    valid = in_table & (slots >= 0)
    kv_c, k_pe = gather_latent(kv_cache, slots, valid, scale, layout, q_pe.shape[-1])  # [T, K, *]

    # Each token is its own group of one query over its K keys.
    out, lse = latent_attention(q_nope[:, None], q_pe[:, None], kv_c, k_pe, valid[:, None, :], softmax_scale)
    return out[:, 0].to(q_nope.dtype).contiguous(), lse[:, 0].contiguous()


@sparse_mla.register_fake
def sparse_mla_fake(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale):
    _check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)
