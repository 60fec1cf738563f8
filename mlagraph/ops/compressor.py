"""DeepSeek-V4 compressors (CSA, HCA and the CSA indexer's) and the CSA lightning indexer.

A compressor turns every m tokens of a layer's input into one entry. Per token it has a value
``kv`` and a gate ``gate + position_bias[p % m]``, each C wide; entry ``i`` is, per feature, the
gate-softmax-weighted sum of the values in its slots, then RMS-normed (times ``norm_weight``)
and rotated (interleaved RoPE on its last R dims) at position ``i·m``:

- without overlap (HCA, C = W): the slots are tokens ``i·m .. i·m+m-1``;
- with overlap (CSA and its indexer, C = 2W, halves Ca | Cb): the slots are the Ca halves of the
  previous window's tokens ``(i-1)·m .. i·m-1`` (none for i = 0) and the Cb halves of window
  i's tokens: 2m slots, stride m.

``compressor_update`` keeps the running state explicit: it writes each new token's
``kv | gate + bias`` row into the paged state cache, then, for every token that closes a window
(``(p + 1) % m == 0``), pools that window from the state cache (earlier steps' tokens included)
and writes the entry into the compressed-entry cache (layouts: :mod:`.v4_layouts`). So chunked
prefill and decode need no state beyond the caches.

``csa_indexer_topk`` scores a token's query heads against the indexer's compressed keys,
``sum_h w[t, h] · relu(q[t, h] . k[i]) · softmax_scale``, and keeps the top ``topk`` entries the
token can see.
"""

from __future__ import annotations

import torch

from . import layouts
from . import v4_layouts as v4
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_positive, check_tensor, fail
from ._define import custom_op
from .rope import rope_reference
from .swa import visible_entries

# ---------------------------------------------------------------------------------------------
# compressor_update


def _check_compressor(kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping,
                      block_table, state_cache, compressed_cache, compress_rate, overlap, eps) -> None:
    op = "compressor_update"
    check_tensor(op, "kv", kv, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = kv.shape
    dev = kv.device
    check_positive(op, "compress_rate", compress_rate)
    if overlap and width % 2:
        fail(op, "kv", "an even last dim (the Ca | Cb halves) when overlap is True", f"shape {list(kv.shape)}")
    out_width = width // 2 if overlap else width
    check_tensor(op, "gate", gate, shape=(num_tokens, width), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "position_bias", position_bias, shape=(compress_rate, width), dtypes=(torch.float32,), device=dev)
    check_tensor(op, "norm_weight", norm_weight, shape=(out_width,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=dev)
    rope_dim = cos_sin_cache.shape[1]
    if rope_dim % 2 or rope_dim > out_width:
        fail(op, "cos_sin_cache", f"an even rope dim <= the entry width {out_width}", f"shape {list(cos_sin_cache.shape)}")
    check_tensor(op, "positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor(op, "req_ids", req_ids, shape=(num_tokens,), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=(torch.int64,), device=dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor(op, "state_cache", state_cache, shape=(None, None, 2 * width), dtypes=(torch.float32,), device=dev)
    num_pages, page_size = state_cache.shape[0], state_cache.shape[1]
    if not v4.rates_compatible(page_size, compress_rate):
        fail(op, "compress_rate", f"a divisor or multiple of the page size {page_size}", compress_rate)
    rows = v4.entries_per_page(page_size, compress_rate)
    check_tensor(op, "compressed_cache", compressed_cache, shape=(num_pages, rows, out_width), dtypes=FLOAT_DTYPES,
                 device=dev)
    check_positive(op, "eps", eps)


@custom_op("mlagraph::compressor_update", mutates_args=("state_cache", "compressed_cache"))
def compressor_update(
    kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor, slot_mapping: torch.Tensor,
    block_table: torch.Tensor, state_cache: torch.Tensor, compressed_cache: torch.Tensor, compress_rate: int,
    overlap: bool, eps: float,
) -> None:
    """Appends T tokens to their requests' compressor state and writes the entries they close.

    Args:
        kv, gate: [T, C] float32/bfloat16/float16, the compressor's two projections of the
            layer input (C = 2W with overlap, else W).
        position_bias: [m, C] float32, added to the gate by position within the window.
        norm_weight: [W], the entries' RMSNorm weight.
        cos_sin_cache: [max_pos, R] float32 RoPE table (``rope_cos_sin_cache``), R <= W.
        positions: [T] int32/int64; req_ids: [T] int32; slot_mapping: [T] int64 (-1 = padding);
        block_table: [B, P] int32: the engine's batch metadata.
        state_cache: [num_pages, page_size, 2C] float32, mutated (``kv | gate + bias`` rows).
        compressed_cache: [num_pages, max(page_size // m, 1), W], mutated (closed entries).
        compress_rate: m; divides the page size or is a multiple of it.
        overlap: the CSA scheme (2m slots, stride m) instead of HCA's disjoint windows.
        eps: the RMSNorm epsilon.
    """
    _check_compressor(kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping,
                      block_table, state_cache, compressed_cache, compress_rate, overlap, eps)
    m, width = compress_rate, kv.shape[1]
    out_width = width // 2 if overlap else width
    pos = positions.long()
    bias = position_bias[pos.remainder(m)]
    layouts.scatter_rows(state_cache, slot_mapping, torch.cat([kv.float(), gate.float() + bias], dim=-1))

    closes = (pos + 1).remainder(m) == 0  # [T]
    entry = torch.div(pos, m, rounding_mode="floor")  # [T]
    # The slots of each token's entry: previous window (overlap only), then its own window.
    start = (entry - 1) * m if overlap else entry * m
    slot_pos = start[:, None] + torch.arange(2 * m if overlap else m, device=kv.device)  # [T, S]
    slots = v4.token_slots(block_table, req_ids[:, None], slot_pos, state_cache.shape[1])
    rows, valid = v4.gather_rows(state_cache, slots)  # [T, S, 2C]
    values, gates = rows[..., :width], rows[..., width:]
    if overlap:  # slot j < m: Ca of the previous window; j >= m: Cb of this one
        ca = torch.arange(2 * m, device=kv.device)[None, :, None] < m  # [1, S, 1]
        values = torch.where(ca, values[..., :out_width], values[..., out_width:])
        gates = torch.where(ca, gates[..., :out_width], gates[..., out_width:])
    # Tokens that close nothing still compute (fixed shapes); 0 gates keep their softmax finite.
    gates = torch.where(valid[..., None], gates, float("-inf"))
    gates = torch.where(closes[:, None, None], gates, 0.0)
    pooled = (values * gates.softmax(dim=1)).sum(dim=1)  # [T, W] float32
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    rope_dim = cos_sin_cache.shape[1]
    rotated = rope_reference(normed[:, None, -rope_dim:], normed[:, None, -rope_dim:], entry * m, cos_sin_cache,
                             True)[0][:, 0]
    entries = torch.cat([normed[:, :-rope_dim], rotated], dim=-1).to(compressed_cache.dtype)
    dest = v4.entry_slots(block_table, req_ids, torch.where(closes, entry, -1), state_cache.shape[1], m)
    layouts.scatter_rows(compressed_cache, dest, entries)


@compressor_update.register_fake
def _compressor_update_fake(kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping,
                            block_table, state_cache, compressed_cache, compress_rate, overlap, eps) -> None:
    _check_compressor(kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping,
                      block_table, state_cache, compressed_cache, compress_rate, overlap, eps)


# ---------------------------------------------------------------------------------------------
# csa_indexer_topk


def _check_indexer(q, weights, index_cache, positions, req_ids, block_table, page_size, compress_rate, topk,
                   softmax_scale) -> None:
    op = "csa_indexer_topk"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    dev = q.device
    check_tensor(op, "weights", weights, shape=(num_tokens, num_heads), dtypes=(torch.float32,), device=dev)
    check_positive(op, "page_size", page_size)
    check_positive(op, "compress_rate", compress_rate)
    if not v4.rates_compatible(page_size, compress_rate):
        fail(op, "compress_rate", f"a divisor or multiple of the page size {page_size}", compress_rate)
    rows = v4.entries_per_page(page_size, compress_rate)
    check_tensor(op, "index_cache", index_cache, shape=(None, rows, head_dim), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor(op, "positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=dev)
    check_tensor(op, "req_ids", req_ids, shape=(num_tokens,), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_positive(op, "topk", topk)
    check_positive(op, "softmax_scale", softmax_scale)


@custom_op("mlagraph::csa_indexer_topk", mutates_args=())
def csa_indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, positions: torch.Tensor,
    req_ids: torch.Tensor, block_table: torch.Tensor, page_size: int, compress_rate: int, topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """The entries each token's CSA attention reads: [T, topk] int32 entry indices, -1 = none.

    Args:
        q: [T, Hi, Di] float32/bfloat16/float16, rotated indexer queries.
        weights: [T, Hi] float32 per-head weights (the model's ``weights_proj``, scaled).
        index_cache: [num_pages, max(page_size // m, 1), Di] the indexer's compressed keys.
        positions, req_ids, block_table: the batch metadata (as in ``csa_attention``).
        page_size: tokens per page of the block table.
        compress_rate: m of the indexer's compressor (the CSA rate).
        topk: entries kept per token. A token that sees fewer keeps them all (in any order)
            and pads with -1.
        softmax_scale: > 0, multiplies each head's relu(q . k).

    Scores every entry the block table can address and masks those the token cannot see
    (or that are not written): no data-dependent shapes.
    """
    _check_indexer(q, weights, index_cache, positions, req_ids, block_table, page_size, compress_rate, topk,
                   softmax_scale)
    max_entries = block_table.shape[1] * page_size // compress_rate
    entries = torch.arange(max_entries, device=q.device)[None, :]  # [1, E]
    keys, written = v4.gather_rows(index_cache, v4.entry_slots(block_table, req_ids[:, None], entries, page_size,
                                                               compress_rate))  # [T, E, Di]
    dots = torch.einsum("thd,ted->the", q.float(), keys)
    scores = (torch.relu(dots) * softmax_scale * weights[:, :, None]).sum(dim=1)  # [T, E]
    seen = written & visible_entries(positions, entries, compress_rate)
    scores = scores.masked_fill(~seen, float("-inf"))
    k = min(topk, max_entries)
    picked = torch.topk(scores, k, dim=-1).indices  # [T, k]
    picked = torch.where(seen.gather(1, picked), picked, -1).to(torch.int32)
    if k < topk:
        picked = torch.cat([picked, picked.new_full((picked.shape[0], topk - k), -1)], dim=1)
    return picked


@csa_indexer_topk.register_fake
def _csa_indexer_topk_fake(q, weights, index_cache, positions, req_ids, block_table, page_size, compress_rate, topk,
                           softmax_scale):
    _check_indexer(q, weights, index_cache, positions, req_ids, block_table, page_size, compress_rate, topk,
                   softmax_scale)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)
