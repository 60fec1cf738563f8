"""Calls into FlashMLA (``sgl-flash-mla``'s legacy SM90 kernels) behind mlagraph's op contracts.

Each function takes the generic op's positional arguments (the twin has checked them) and
returns what the generic op returns. Contracts as read in sgl-flash-mla 1.0.0
(``flash_mla/flash_mla_interface.py`` and the op schemas its ``_C_legacy`` extension registers):

``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched_meta, ...,
use_legacy=True)``
    q ``[B, s_q, H, 576]`` bf16; k_cache ``[pages, page, 1, W]``. Dense (``indices=None``):
    bf16 rows (W = 576), page 64 only, ``causal`` masks within the s_q new tokens. Sparse
    (``indices [B, s_q, K]`` int32 flat slots page * page_size + offset, -1 = none, no upper
    bound check; ``is_fp8_kvcache=True``): the 656-byte V3.2 rows viewed as float8_e4m3fn, 64 or
    128 heads. Returns out ``[B, s_q, H, 512]`` and lse ``[B, H, s_q]`` (natural log; +inf for
    a query with no key). ``sched_meta`` (``get_mla_metadata()[0]``) is filled by the first call
    and may be reused while shapes and lengths stay the same: one per step (host_plan).
``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, use_legacy=True)``
    q ``[T, H, 576]``, kv ``[S, 1, 576]`` bf16 rows, indices ``[T, 1, K]`` int32 (-1 or >= S:
    none) -> (out ``[T, H, 512]``, max_logits, lse ``[T, H]`` natural log).

What the wrappers add, on the device once per step (mlagraph.ops._paged): lengths cut at the
first -1 page and block tables with -1 clamped to page 0 (FlashMLA reads the pages a length
covers, and a padding request must not send it to page -1); flat slot indices from our
per-request positions; index widths padded to a multiple of 64 with -1; and out 0 / lse -inf
for requests and queries without a key.
"""

from __future__ import annotations

import torch

from .. import host_plan
from .._paged import effective_lens, flat_slots, flat_slots_padded, mask_empty, pad_last
from ..backends import hardware_problem
from . import CAPABILITIES, LATENT, LIBRARY

# Index lists are padded with -1 to a multiple of these: the decode kernels read them in blocks
# of 64, the sparse prefill kernel in pairs of 64-blocks (it asserts topk % 128 == 0).
_TOPK_BLOCK = 64
_PREFILL_TOPK_BLOCK = 128


def _flash_mla(op: str, like: torch.Tensor):
    problem = hardware_problem(CAPABILITIES, like.device)
    if problem:
        raise ValueError(f"flashmla.{op}: {problem}")
    return LIBRARY.load()


def _joined(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[..., L] and [..., R] -> [..., L + R]: a view when they are adjacent parts of one buffer
    (the fused op's q, split by the model), else a cat."""
    lat = q_nope.shape[-1]
    if (q_nope.stride() == q_pe.stride() and q_nope.stride(-1) == 1
            and q_nope.untyped_storage().data_ptr() == q_pe.untyped_storage().data_ptr()
            and q_pe.storage_offset() == q_nope.storage_offset() + lat):
        joined = q_nope.as_strided((*q_nope.shape[:-1], lat + q_pe.shape[-1]), q_nope.stride(),
                                   q_nope.storage_offset())
        if all(s >= lat + q_pe.shape[-1] for s, n in zip(q_nope.stride()[:-1], q_nope.shape[:-1]) if n > 1):
            return joined
    return torch.cat([q_nope, q_pe], dim=-1)


class _DecodeMeta:
    """One step's decode metadata: lengths, table, empty mask, index lists, FlashMLA's scheduler.
    ``fill`` recomputes them in place (a graph replay's refresh)."""

    def __init__(self, fm, block_table, seq_lens, page_size: int, s_q: int, sparse: bool):
        self.fm, self.block_table, self.seq_lens = fm, block_table, seq_lens
        self.page_size, self.s_q, self.sparse = page_size, s_q, sparse
        self.sched = fm.get_mla_metadata()[0]
        self.tensors = self._compute()

    def _compute(self) -> dict[str, torch.Tensor]:
        lens = effective_lens(self.block_table, self.seq_lens, self.page_size)
        out = {"empty": lens == 0, "table": self.block_table.clamp_min(0), "lens": lens.clamp_min(1)}
        if self.sparse:  # every visible position of every query, as flat slots
            b, p = self.block_table.shape
            width = p * self.page_size
            pos = torch.arange(width, device=lens.device)
            q_pos = lens[:, None].long() - self.s_q + torch.arange(self.s_q, device=lens.device)  # [B, s_q]
            visible = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < lens[:, None, None])
            rows = torch.arange(b, device=lens.device)
            slots = flat_slots(self.block_table, pos.expand(b, width), rows, self.page_size)  # [B, W]
            idx = torch.where(visible, slots[:, None, :], -1).to(torch.int32)
            # No topk_length: FlashMLA's sparse scheduler then depends on shapes only, so a
            # captured graph's metadata stays valid at every replay (the work is the table's width).
            out["indices"] = pad_last(idx, _TOPK_BLOCK)
        return out

    def refresh(self, _step) -> None:
        for name, t in self._compute().items():
            self.tensors[name].copy_(t)
        # Dense decode's scheduler splits by length: a graph captured after a warm-up holds the
        # warm-up's metadata, so refill it from the new lengths into the buffers the graph reads.
        if not self.sparse and self.sched.tile_scheduler_metadata is not None:
            meta, splits = self.fm.get_mla_decoding_metadata(
                self.tensors["lens"], self.s_q * self.heads, 1, self.heads, False, None, use_legacy=True)
            self.sched.tile_scheduler_metadata.copy_(meta)
            self.sched.num_splits.copy_(splits)

    heads = 0


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale):
    """Returns (out [B, s_q, H, L] bf16, lse [B, s_q, H] float32)."""
    fm = _flash_mla("mla_decode", q_nope)
    batch, s_q, heads, _ = q_nope.shape
    if batch == 0:
        return q_nope.new_empty(q_nope.shape), q_nope.new_empty((0, s_q, heads), dtype=torch.float32)
    pages, page_size, width = kv_cache.shape
    sparse = layout == "fp8_ds"
    key = ("flashmla.mla_decode", host_plan.tensor_key(block_table), host_plan.tensor_key(seq_lens), s_q, heads,
           page_size, sparse)

    def make(_step):
        m = _DecodeMeta(fm, block_table, seq_lens, page_size, s_q, sparse)
        m.heads = heads
        return m

    meta = host_plan.plan(key, make, _DecodeMeta.refresh)
    t = meta.tensors
    q = _joined(q_nope, q_pe)
    if sparse:
        cache = kv_cache.view(torch.float8_e4m3fn).view(pages, page_size, 1, width)
        out, lse = fm.flash_mla_with_kvcache(
            q, cache, None, None, LATENT, meta.sched, softmax_scale=float(softmax_scale), causal=False,
            is_fp8_kvcache=True, indices=t["indices"], use_legacy=True)
    else:
        out, lse = fm.flash_mla_with_kvcache(
            q, kv_cache.unsqueeze(2), t["table"], t["lens"], LATENT, meta.sched, softmax_scale=float(softmax_scale),
            causal=s_q > 1, use_legacy=True)
    return mask_empty(out, lse.transpose(1, 2), t["empty"])


def sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale):
    """Returns (out [T, H, L] bf16, lse [T, H] float32)."""
    fm = _flash_mla("sparse_mla", q_nope)
    tokens, heads, _ = q_nope.shape
    if tokens == 0:
        return q_nope.new_empty(q_nope.shape), q_nope.new_empty((0, heads), dtype=torch.float32)
    pages, page_size, width = kv_cache.shape
    block = _PREFILL_TOPK_BLOCK if layout == "bf16" else _TOPK_BLOCK
    idx, empty = flat_slots_padded(block_table, topk_indices, req_ids, page_size, block)  # [T, K'], [T]
    q = _joined(q_nope, q_pe)
    if layout == "bf16":
        out, _, lse = fm.flash_mla_sparse_fwd(q, kv_cache.view(pages * page_size, 1, width), idx[:, None, :],
                                              float(softmax_scale), d_v=LATENT, use_legacy=True)
        return mask_empty(out, lse, empty)
    key = ("flashmla.sparse_mla", tokens, heads, idx.shape[-1], page_size)
    sched = host_plan.plan(key, lambda _s: fm.get_mla_metadata()[0])
    cache = kv_cache.view(torch.float8_e4m3fn).view(pages, page_size, 1, width)
    out, lse = fm.flash_mla_with_kvcache(
        q[:, None], cache, None, None, LATENT, sched, softmax_scale=float(softmax_scale), causal=False,
        is_fp8_kvcache=True, indices=idx[:, None, :], use_legacy=True)
    return mask_empty(out[:, 0], lse[:, :, 0], empty)
