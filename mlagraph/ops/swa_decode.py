"""Decode forms of DeepSeek-V4's attentions: ``swa_decode``, ``hca_decode``, ``csa_decode``.

The same math as :mod:`.swa`'s token-major ops, for a decode batch: every request brings the
same number s_q of new tokens (1, or a few when verifying speculated ones), and query i of
request b sits at position ``seq_lens[b] - s_q + i``, like ``mla_decode``. The batch-major
shape [B, s_q, H, D] is what a split-KV decode kernel wants (a fixed grid over requests);
these references derive each query's position and request and run the token-major math.
"""

from __future__ import annotations

import torch

from . import swa
from ._checks import check_tensor
from ._define import custom_op, dense_empty


def _check_decode(op, q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale, compressed=None,
                  compress_rate=None, topk_indices=None) -> None:
    swa.check_queries(op, q, 4, kv_cache, sinks, window, softmax_scale)
    batch, s_q = q.shape[0], q.shape[1]
    dev = q.device
    check_tensor(op, "block_table", block_table, shape=(batch, None), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "seq_lens", seq_lens, shape=(batch,), dtypes=(torch.int32,), device=dev)
    if compressed is not None:
        swa.check_compressed(op, q, kv_cache, compressed, compress_rate)
    if topk_indices is not None:
        check_tensor(op, "topk_indices", topk_indices, shape=(batch, s_q, None), dtypes=(torch.int32,), device=dev)


# One check per op, with the op's signature: the op, its fake and every backend's twin call it.


def check_swa_decode(q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale) -> None:
    _check_decode("swa_decode", q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale)


def check_hca_decode(q, kv_cache, compressed_cache, sinks, block_table, seq_lens, window, compress_rate,
                     softmax_scale) -> None:
    _check_decode("hca_decode", q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale, compressed_cache,
                  compress_rate)


def check_csa_decode(q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window,
                     compress_rate, softmax_scale) -> None:
    _check_decode("csa_decode", q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale, compressed_cache,
                  compress_rate, topk_indices)


def _queries(q: torch.Tensor, seq_lens: torch.Tensor):
    """q [B, s_q, H, D] -> (q [B·s_q, H, D], positions [B·s_q] int64, req_ids [B·s_q] int32).

    A padding request (seq_lens 0) gets negative positions: it sees no key and no entry."""
    batch, s_q = q.shape[0], q.shape[1]
    positions = seq_lens.long()[:, None] - s_q + torch.arange(s_q, device=q.device)
    req_ids = torch.arange(batch, device=q.device, dtype=torch.int32)[:, None].expand(batch, s_q)
    return q.flatten(0, 1), positions.flatten(), req_ids.flatten()


def _unflatten(q, out_lse):
    out, lse = out_lse
    return out.view(q.shape), lse.view(q.shape[:3])


def _fake(q):
    # strides written out (dense_empty): the model views out as [T, H, D] with no guard
    return dense_empty(q, q.shape), dense_empty(q, q.shape[:3], torch.float32)


@custom_op("mlagraph::swa_decode", mutates_args=())
def swa_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    window: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swa_attention`` for q [B, s_q, H, D]; seq_lens [B] int32 tokens in the cache per request,
    the s_q new ones included (0: padding, out 0). Returns out [B, s_q, H, D], lse [B, s_q, H]."""
    check_swa_decode(q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale)
    flat, positions, req_ids = _queries(q, seq_lens)
    return _unflatten(q, swa.swa_math(flat, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale))


@swa_decode.register_fake
def swa_decode_fake(q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale):
    check_swa_decode(q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale)
    return _fake(q)


@custom_op("mlagraph::hca_decode", mutates_args=())
def hca_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, compressed_cache: torch.Tensor, sinks: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, window: int, compress_rate: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hca_attention`` for q [B, s_q, H, D] (seq_lens as in ``swa_decode``)."""
    check_hca_decode(q, kv_cache, compressed_cache, sinks, block_table, seq_lens, window, compress_rate,
                     softmax_scale)
    flat, positions, req_ids = _queries(q, seq_lens)
    return _unflatten(q, swa.hca_math(flat, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window,
                                      compress_rate, softmax_scale))


@hca_decode.register_fake
def hca_decode_fake(q, kv_cache, compressed_cache, sinks, block_table, seq_lens, window, compress_rate,
                     softmax_scale):
    check_hca_decode(q, kv_cache, compressed_cache, sinks, block_table, seq_lens, window, compress_rate,
                     softmax_scale)
    return _fake(q)


@custom_op("mlagraph::csa_decode", mutates_args=())
def csa_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, compressed_cache: torch.Tensor, topk_indices: torch.Tensor,
    sinks: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, window: int, compress_rate: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``csa_attention`` for q [B, s_q, H, D], topk_indices [B, s_q, K] int32 (seq_lens as in
    ``swa_decode``)."""
    check_csa_decode(q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window,
                     compress_rate, softmax_scale)
    flat, positions, req_ids = _queries(q, seq_lens)
    return _unflatten(q, swa.csa_math(flat, kv_cache, compressed_cache, topk_indices.flatten(0, 1), sinks, positions,
                                      req_ids, block_table, window, compress_rate, softmax_scale))


@csa_decode.register_fake
def csa_decode_fake(q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window, compress_rate,
                     softmax_scale):
    check_csa_decode(q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window,
                     compress_rate, softmax_scale)
    return _fake(q)
