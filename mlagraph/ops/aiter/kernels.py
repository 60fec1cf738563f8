"""Launchers for aiter's two Triton MLA kernels behind mlagraph's op contracts.

Each function takes the SAME positional arguments as the generic op (the backend's op twin has
already run the argument checks) and returns what the twin returns. aiter is loaded on the first
call through :func:`mlagraph.ops.aiter.load` (no ROCm needed). Contracts as read in amd-aiter
0.1.7.post2.dev18 (pinned in pyproject.toml):

``fused_rope_concat_cache_write`` -> ``fused_kv_cache.fused_qk_rope_cat_and_cache_mla``
    One program per (token, q head): rotates q_pe (GPT-J pairs or NeoX halves, in float32
    against our float32 cos/sin table, passed as two views ``[:, :R/2]`` / ``[:, R/2:]``, no
    copy), writes ``q = [q_nope | q_rot]`` to a new tensor, and for head 0 rotates k_pe and
    writes ``[kv_c | k_rot] * (1 / k_scale)`` to the cache row of every slot >= 0 (the cache is
    addressed as flat rows ``[pages * page_size, 1, L + R]``: page size 1 to aiter, any page
    size to us). It returns ``(q_out, decode_q_pe_out, k_pe_out, kv_cache)``:
    ``decode_q_pe_out`` is an EMPTY ``[0, H, R]`` tensor (we ask for no decode tokens),
    ``k_pe_out`` holds rotated k_pe only for tokens with slot >= 0 (uninitialized memory for
    padding), and ``kv_cache`` is our cache, mutated. We return q and an EMPTY K of shape
    ``[0]`` (:data:`EMPTY_K_SHAPE`): aiter's K is not a usable output, so the backend declares
    ``fused_returns_k=False`` and no consumer may read it. Layouts: ``bf16`` (the model dtype)
    and ``fp8`` (e4m3 with the per-tensor scale; aiter multiplies by the reciprocal of the scale
    and does not clamp to +-448, so values past the e4m3 range, or a product that rounds
    differently from our division, can give other bytes than our writer: tests check bytes on
    in-range values). No ``fp8_ds`` (no per-group scales).

``mla_decode`` -> ``mla_decode_rope.decode_attention_fwd_grouped_rope`` (use_rope=False)
    Stage 1: grid ``cdiv(H, BLOCK_H) * B * num_kv_splits``; each program runs flash-decoding over
    one split of one request's keys, with q read CONCATENATED ``[B, H, L + R]`` (unit last
    stride) and keys read through a flat token index ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
    into the flat cache rows; it stores the split's normalized output and its log-sum-exp in
    ``attn_logits [B, H, splits, L + 1]``. Stage 2 (grid ``B * H``) merges the splits. It has
    no per-tensor scale input (so no ``fp8`` cache), one query per request (s_q = 1: no causal
    mask inside the new tokens), returns no lse, and gives NaN (0/0) for a request with no key.
    Batch size and head count are ``tl.constexpr`` in both kernels: each new batch size
    compiles new kernels on the GPU (warm up before capture; engines pad to buckets).

    What this wrapper adds, all on the device with shapes fixed by the inputs' shapes (no host
    sync, capturable): the metadata (every position of the block table's width, kept where
    ``pos < seq_len`` and the page is not -1, packed request after request into a
    ``[B * P * page_size + 1]`` index buffer whose last entry absorbs the dropped positions;
    ``kv_indptr`` = a cumulative sum of the kept counts); q joined without a copy when q_nope
    and q_pe are adjacent views of one buffer (what the fused op's q is), else a cat; out = 0
    for a request with no kept key; and the lse, merged from the splits' partial lse in
    ``attn_logits[..., L]`` (the splits a request's keys fill are known from its kept count,
    exactly as the kernels cut them) -> -inf for a request with no key.

aiter's own per-GPU configs are JSON files for AMD GPUs only: every call passes an explicit
config (:class:`DecodeConfig`), chosen from shapes by :func:`default_decode_config`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .. import layouts
from . import EMPTY_K_SHAPE
from ..triton._hardware import H200_SMS, hardware
from ..triton._launch import check_runnable
from ._loader import load
_WAVES = 2  # stage-1 programs to aim for per SM


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """aiter.ops.triton.<name>, loaded once (keeps the loader's look-ups off the call path)."""
    return load(name)


def _check_runnable(op: str, kernel, tensor: torch.Tensor) -> None:
    """aiter's kernels were defined when aiter was first loaded (interpreted if TRITON_INTERPRET=1
    was set then)."""
    check_runnable(op, kernel, tensor, "mlagraph_aiter", "before aiter's kernels are first loaded")


def _flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_pages, page_size, W] -> a view [num_pages * page_size, 1, W] of the same rows (the
    generic checks guarantee pages are dense: stride(0) == page_size * stride(1) when both
    dims exceed 1)."""
    pages, page_size, width = kv_cache.shape
    row = kv_cache.stride(0) if page_size == 1 else kv_cache.stride(1)
    return kv_cache.as_strided((pages * page_size, 1, width), (row, row, kv_cache.stride(2)),
                               kv_cache.storage_offset())


# ---------------------------------------------------------------------------------------------
# fused RoPE -> concat -> cache write


def fused_rope_concat_cache_write(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping,
                                  scale, layout, interleaved):
    """Returns (q [T, H, Dn + R], an empty K [0]); writes the cache rows of slots >= 0."""
    fused = _module("fused_kv_cache")
    _check_runnable("fused_rope_concat_cache_write", fused._fused_qk_rope_cat_and_cache_mla_kernel, q_nope)
    t, h, dn = q_nope.shape
    empty_k = k_pe.new_empty(EMPTY_K_SHAPE)
    if t == 0:
        return q_nope.new_empty((0, h, dn + q_pe.shape[2])), empty_k
    half = cos_sin_cache.shape[1] // 2
    q, _, _, _ = fused.fused_qk_rope_cat_and_cache_mla(
        q_nope, q_pe, kv_c.unsqueeze(1), k_pe, _flat_rows(kv_cache), slot_mapping, positions,
        cos_sin_cache[:, :half], cos_sin_cache[:, half:], scale if layout == "fp8" else None,
        not interleaved,
    )
    return q, empty_k


# ---------------------------------------------------------------------------------------------
# decode


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch options of aiter's two decode kernels.

    block_h: heads per stage-1 program (>= 16 on the GPU: tl.dot needs 16 rows).
    block_n: keys per stage-1 step. num_kv_splits: splits per request (None: from shapes).
    num_warps / num_stages: stage 1; stage2_num_warps / stage2_num_stages: the merge kernel.
    Defaults: aiter's MI300 config without its AMD-only keys (waves_per_eu, kpack, ...), which
    the H200 peer runs used (benchmarks/aiter_peers.py); a benchmark can sweep them.
    """

    block_h: int = 16
    block_n: int = 32
    num_kv_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 1
    stage2_num_warps: int = 4
    stage2_num_stages: int = 2

    def aiter_dict(self, num_kv_splits: int) -> dict:
        # A fresh dict per call: aiter writes BLOCK_C / NUM_KV_SPLITS into the one it is given.
        return {
            "fwd_grouped_kernel_stage1_rope": {"BLOCK_H": self.block_h, "BLOCK_N": self.block_n,
                                               "num_warps": self.num_warps, "num_stages": self.num_stages},
            "fwd_kernel_stage2": {"num_warps": self.stage2_num_warps, "num_stages": self.stage2_num_stages},
        }


def default_decode_config(batch: int, heads: int, max_len: int, num_sms: int = H200_SMS) -> DecodeConfig:
    """Splits from shapes only: enough stage-1 programs for two waves of the SMs, at most 16
    splits, and no split shorter than 4 blocks of the table's capacity (``max_len``, not the
    actual lengths, which only the device knows)."""
    base = DecodeConfig()
    programs = max(1, batch * math.ceil(heads / base.block_h))
    splits = min(math.ceil(_WAVES * num_sms / programs), 16, max(1, max_len // (4 * base.block_n)))
    return dataclasses.replace(base, num_kv_splits=max(1, splits))


def decode_metadata(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, index_dtype: torch.dtype):
    """aiter's flat-token metadata, on the device with fixed shapes.

    Returns (kv_indptr [B + 1] int32, kv_indices [B * P * page_size + 1] ``index_dtype``,
    kept [B] int64): request b's keys are rows ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``,
    its positions < seq_len whose page is not -1, in order; ``kept`` counts them.
    """
    batch, max_pages = block_table.shape
    max_len = max_pages * page_size
    slots = layouts.slots_from_block_table(block_table, page_size, max_len)  # [B, S], -1 on page -1
    pos = torch.arange(max_len, device=block_table.device)
    keep = (pos[None, :] < seq_lens.long()[:, None]) & (slots >= 0)
    kept = keep.sum(1)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=block_table.device)
    indptr[1:] = kept.cumsum(0)
    # Kept position i of request b goes to indptr[b] + (its rank among b's kept positions);
    # every dropped one to the spare last entry, which no request's range reaches.
    dest = torch.where(keep, indptr[:-1, None].long() + keep.long().cumsum(1) - 1, batch * max_len)
    indices = torch.zeros(batch * max_len + 1, dtype=index_dtype, device=block_table.device)
    indices.scatter_(0, dest.flatten(), slots.clamp_min(0).flatten().to(index_dtype))
    return indptr, indices, kept


def _joined_q(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[B, H, L] and [B, H, R] -> [B, H, L + R] with unit last stride, as aiter reads q: a view
    when they are adjacent slices of one buffer (the fused op's q), else a cat."""
    lat = q_nope.shape[-1]
    adjacent = (
        q_nope.stride() == q_pe.stride() and q_nope.stride(-1) == 1
        and q_pe.data_ptr() == q_nope.data_ptr() + lat * q_nope.element_size()
        and q_nope.untyped_storage().data_ptr() == q_pe.untyped_storage().data_ptr()
        and all(s >= lat + q_pe.shape[-1] for s, n in zip(q_nope.stride()[:-1], q_nope.shape[:-1]) if n > 1)
    )
    if adjacent:
        return q_nope.as_strided((*q_nope.shape[:-1], lat + q_pe.shape[-1]), q_nope.stride(),
                                 q_nope.storage_offset())
    return torch.cat([q_nope, q_pe], dim=-1)


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale,
               config: DecodeConfig | None = None):
    """Returns (out [B, 1, H, L] in q's dtype, lse [B, 1, H] float32). s_q = 1, layout "bf16"
    (the twin's checks enforce both). ``config``: a :class:`DecodeConfig` override (sweeps)."""
    decode = _module("mla_decode_rope")
    _check_runnable("mla_decode", decode._fwd_grouped_kernel_stage1_rope, q_nope)
    batch, _, heads, lat = q_nope.shape
    out = q_nope.new_empty((batch, heads, lat))
    if batch == 0:
        return out.unsqueeze(1), q_nope.new_empty((0, 1, heads), dtype=torch.float32)
    pages, page_size, width = kv_cache.shape
    max_len = block_table.shape[1] * page_size
    default = default_decode_config(batch, heads, max_len, hardware(q_nope.device).num_sms)
    config = config or default
    splits = config.num_kv_splits or default.num_kv_splits
    # The kernel multiplies a loaded index by the row stride in the index's integer type.
    index_dtype = torch.int32 if pages * page_size * width < 2**31 else torch.int64
    indptr, indices, kept = decode_metadata(block_table, seq_lens, page_size, index_dtype)
    rows = _flat_rows(kv_cache)
    partial = torch.empty((batch, heads, splits, lat + 1), dtype=torch.float32, device=q_nope.device)
    decode.decode_attention_fwd_grouped_rope(
        _joined_q(q_nope[:, 0], q_pe[:, 0]), rows, rows[..., :lat], out, indptr, indices, None, lat,
        width - lat, None, None, partial, splits, float(softmax_scale), use_rope=False,
        config=config.aiter_dict(splits),
    )
    empty = (kept == 0)[:, None, None]
    out.masked_fill_(empty, 0.0)  # aiter's 0/0 for a request with no key
    # The kernels cut n kept keys into splits of ceil(n / splits); split s holds keys iff it starts < n.
    per_split = (kept[:, None] + splits - 1) // splits
    filled = per_split * torch.arange(splits, device=q_nope.device)[None, :] < kept[:, None]  # [B, splits]
    lse = torch.where(filled[:, None, :], partial[..., lat], float("-inf")).logsumexp(-1)  # [B, H]
    return out.unsqueeze(1), lse.unsqueeze(1)
