"""DeepSeek-V4 attention: shared K=V MQA over a sliding window, with per-head sinks.

Every V4 layer attends to the last ``window`` tokens of its request (itself included) from the
paged window cache (:mod:`.v4_layouts`); compressed layers add entries of their compressed
stream to the SAME softmax:

- ``swa_attention``: the window only (sliding layers);
- ``hca_attention``: the window + every compressed entry the token can see (HCA layers);
- ``csa_attention``: the window + the compressed entries the indexer selected (CSA layers).

One key row is both key and value (MQA with one shared head). Per head h, over the visible
keys s and the head's learned sink logit (a "key" with no value):

    score[h, s] = softmax_scale * q[h] . k[s]
    p[h, s]     = exp(score[h, s]) / (sum_s exp(score[h, s]) + exp(sink[h]))
    out[h]      = sum_s p[h, s] * k[s]
    lse[h]      = log(sum_s exp(score[h, s]) + exp(sink[h]))     (natural log, float32)

Compressed entry ``i`` (rate m) pools tokens ``i·m .. i·m+m-1``, so token ``p`` may see it once
its window closed: ``(i + 1)·m <= p + 1``. Every op takes the batch token-major (T tokens of
any requests: prefill, chunked prefill and decode alike), reads the window and entries of each
token's request through the block table, and has no data-dependent shape. The decode forms
(:mod:`.swa_decode`) take the same math batch-major, ``[B, s_q]`` queries per request.
"""

from __future__ import annotations

import torch

from . import layouts
from . import v4_layouts as v4
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_positive, check_tensor, fail
from ._define import custom_op

# ---------------------------------------------------------------------------------------------
# window cache write


def _check_swa_cache_write(kv, kv_cache, slot_mapping) -> None:
    op = "swa_cache_write"
    check_tensor(op, "kv", kv, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "kv_cache", kv_cache, shape=(None, None, kv.shape[1]), dtypes=FLOAT_DTYPES, device=kv.device)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(kv.shape[0],), dtypes=(torch.int64,), device=kv.device)


@custom_op("mlagraph::swa_cache_write", mutates_args=("kv_cache",))
def swa_cache_write(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's K=V row into the window cache.

    Args:
        kv: [T, D] float32/bfloat16/float16, rotated and normed.
        kv_cache: [num_pages, page_size, D] float dtype (rows are cast to it).
        slot_mapping: [T] int64 flat slot of each token; -1 (padding) is skipped.
    """
    _check_swa_cache_write(kv, kv_cache, slot_mapping)
    layouts.scatter_rows(kv_cache, slot_mapping, kv.to(kv_cache.dtype))


@swa_cache_write.register_fake
def _swa_cache_write_fake(kv, kv_cache, slot_mapping) -> None:
    _check_swa_cache_write(kv, kv_cache, slot_mapping)


# ---------------------------------------------------------------------------------------------
# shared by the three attentions


def check_queries(op, q, ndim, kv_cache, sinks, window, softmax_scale) -> None:
    """q [..., H, D] with ``ndim`` dims, the window cache, the sinks and the scalars."""
    check_tensor(op, "q", q, ndim=ndim, dtypes=FLOAT_DTYPES)
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    check_tensor(op, "kv_cache", kv_cache, shape=(None, None, head_dim), dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor(op, "sinks", sinks, shape=(num_heads,), dtypes=(torch.float32,), device=q.device)
    check_positive(op, "window", window)
    check_positive(op, "softmax_scale", softmax_scale)


def _check_common(op, q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale) -> None:
    check_queries(op, q, 3, kv_cache, sinks, window, softmax_scale)
    dev = q.device
    check_tensor(op, "positions", positions, shape=(q.shape[0],), dtypes=INDEX_DTYPES, device=dev)
    check_tensor(op, "req_ids", req_ids, shape=(q.shape[0],), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)


def check_compressed(op, q, kv_cache, compressed_cache, compress_rate) -> None:
    check_positive(op, "compress_rate", compress_rate)
    page_size = kv_cache.shape[1]
    if not v4.rates_compatible(page_size, compress_rate):
        fail(op, "compress_rate", f"a divisor or multiple of the page size {page_size}", compress_rate)
    rows = v4.entries_per_page(page_size, compress_rate)
    check_tensor(op, "compressed_cache", compressed_cache, shape=(kv_cache.shape[0], rows, q.shape[-1]),
                 dtypes=FLOAT_DTYPES, device=q.device)


def window_keys(
    kv_cache: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor, block_table: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> keys [T, window, D] float32 of positions p-window+1 .. p, visible [T, window] bool."""
    back = torch.arange(1 - window, 1, device=positions.device)
    slots = v4.token_slots(block_table, req_ids[:, None], positions.long()[:, None] + back, kv_cache.shape[1])
    return v4.gather_rows(kv_cache, slots)


def visible_entries(positions: torch.Tensor, entries: torch.Tensor, compress_rate: int) -> torch.Tensor:
    """entries [T, E] (broadcastable) -> bool: closed by the token's position, (i+1)·m <= p+1."""
    return (entries >= 0) & ((entries.long() + 1) * compress_rate <= positions.long()[:, None] + 1)


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], keys [T, S, D] float32 (also the values), visible [T, S], sinks [H] float32
    -> out [T, H, D] in q's dtype, lse [T, H] float32 (the sink counted in)."""
    # A key that is not visible may be a row nobody wrote (an entry still open): zero it, as
    # its zero weight times NaN would still be NaN.
    keys = torch.where(visible[..., None], keys, 0.0)
    scores = torch.einsum("thd,tsd->ths", q.float(), keys) * softmax_scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
    lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)  # finite: the sink always counts
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("ths,tsd->thd", probs, keys)
    return out.to(q.dtype).contiguous(), lse.contiguous()


# The three attentions' math, token-major, without the checks (the decode forms reuse it).


def swa_math(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale):
    keys, visible = window_keys(kv_cache, positions, req_ids, block_table, window)
    return sink_attention(q, keys, visible, sinks, softmax_scale)


def hca_math(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
             softmax_scale):
    keys, visible = window_keys(kv_cache, positions, req_ids, block_table, window)
    page_size = kv_cache.shape[1]
    max_entries = block_table.shape[1] * page_size // compress_rate
    entries = torch.arange(max_entries, device=q.device)[None, :]  # [1, E]: every entry the table addresses
    slots = v4.entry_slots(block_table, req_ids[:, None], entries, page_size, compress_rate)
    rows, written = v4.gather_rows(compressed_cache, slots)
    seen = written & visible_entries(positions, entries, compress_rate)
    return sink_attention(q, torch.cat([keys, rows], 1), torch.cat([visible, seen], 1), sinks, softmax_scale)


def csa_math(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
             compress_rate, softmax_scale):
    keys, visible = window_keys(kv_cache, positions, req_ids, block_table, window)
    slots = v4.entry_slots(block_table, req_ids[:, None], topk_indices, kv_cache.shape[1], compress_rate)
    rows, written = v4.gather_rows(compressed_cache, slots)
    seen = written & visible_entries(positions, topk_indices, compress_rate)
    return sink_attention(q, torch.cat([keys, rows], 1), torch.cat([visible, seen], 1), sinks, softmax_scale)


def _fake_out(q):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# swa_attention


def _check_swa(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale) -> None:
    _check_common("swa_attention", q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)


@custom_op("mlagraph::swa_attention", mutates_args=())
def swa_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor,
    block_table: torch.Tensor, window: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention with sinks of each token over its request's window cache.

    Args:
        q: [T, H, D] float32/bfloat16/float16, rotated queries.
        kv_cache: [num_pages, page_size, D] window cache, the T tokens already written.
        sinks: [H] float32 per-head sink logits.
        positions: [T] int32/int64 position of each token in its request.
        req_ids: [T] int32 row of ``block_table`` of each token.
        block_table: [B, P] int32 page ids (-1: none).
        window: keys per query: positions p-window+1 .. p.
        softmax_scale: > 0, multiplies q.k.

    Returns:
        out [T, H, D] in q's dtype, lse [T, H] float32 (see the module docstring). A token with
        no key (padding: no pages) gets out 0.
    """
    _check_swa(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)
    return swa_math(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)


@swa_attention.register_fake
def _swa_attention_fake(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale):
    _check_swa(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)
    return _fake_out(q)


# ---------------------------------------------------------------------------------------------
# hca_attention


def _check_hca(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
               softmax_scale) -> None:
    op = "hca_attention"
    _check_common(op, q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)
    check_compressed(op, q, kv_cache, compressed_cache, compress_rate)


@custom_op("mlagraph::hca_attention", mutates_args=())
def hca_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, compressed_cache: torch.Tensor, sinks: torch.Tensor,
    positions: torch.Tensor, req_ids: torch.Tensor, block_table: torch.Tensor, window: int, compress_rate: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swa_attention`` plus, in the same softmax, every compressed entry the token can see.

    Args (beyond ``swa_attention``'s):
        compressed_cache: [num_pages, max(page_size // m, 1), D] compressed entries
            (:mod:`.v4_layouts`), the ones this step closes already written.
        compress_rate: m, tokens per entry; divides the page size or is a multiple of it.

    Reads every entry the block table can address (``P·page_size // m``) and masks: the shapes
    never depend on the lengths.
    """
    _check_hca(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
               softmax_scale)
    return hca_math(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
                    softmax_scale)


@hca_attention.register_fake
def _hca_attention_fake(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window,
                        compress_rate, softmax_scale):
    _check_hca(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
               softmax_scale)
    return _fake_out(q)


# ---------------------------------------------------------------------------------------------
# csa_attention


def _check_csa(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
               compress_rate, softmax_scale) -> None:
    op = "csa_attention"
    _check_common(op, q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale)
    check_compressed(op, q, kv_cache, compressed_cache, compress_rate)
    check_tensor(op, "topk_indices", topk_indices, shape=(q.shape[0], None), dtypes=(torch.int32,), device=q.device)


@custom_op("mlagraph::csa_attention", mutates_args=())
def csa_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, compressed_cache: torch.Tensor, topk_indices: torch.Tensor,
    sinks: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor, block_table: torch.Tensor, window: int,
    compress_rate: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swa_attention`` plus, in the same softmax, the compressed entries at ``topk_indices``.

    Args (beyond ``hca_attention``'s):
        topk_indices: [T, K] int32 entry indices of the token's request (``csa_indexer_topk``);
            -1 = none. Entries the token cannot see yet, or past the block table, are ignored
            like -1. Duplicates would count twice (the indexer never returns any).
    """
    _check_csa(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
               compress_rate, softmax_scale)
    return csa_math(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
                    compress_rate, softmax_scale)


@csa_attention.register_fake
def _csa_attention_fake(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
                        compress_rate, softmax_scale):
    _check_csa(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
               compress_rate, softmax_scale)
    return _fake_out(q)
