"""Calls into FlashInfer (flashinfer-python 0.7.2.post1, fa3) behind mlagraph's op contracts.

Contracts as read in that release (``flashinfer/mla/_batch_mla/_wrapper.py``, ``_contracts.py``,
``_backends/_fa_common.py``; ``flashinfer/prefill.py``):

``BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, qo_indptr=, kv_indptr=,
kv_indices=, kv_len_arr=, backend="fa3")``
    ``plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr),
    num_heads=, head_dim_ckv=512, head_dim_kpe=64, page_size=, causal=, sm_scale=,
    q_data_type=, kv_data_type=, query_layout="split", kv_cache_layout="split",
    lse_mode="basee")`` takes CPU metadata and, with ``use_cuda_graph``, copies it into the
    reserved buffers (fa3 may re-plan into them before each replay);
    ``run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), return_lse=True,
    return_lse_base_on_e=True)`` with q ``[N, H, 512]`` / ``[N, H, 64]`` returns out
    ``[N, H, 512]`` and lse ``[N, H]`` (natural log).
``BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")``
    ``plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=,
    causal=, sm_scale=, q_data_type=)``; ``run(q, k, v, return_lse=True, lse_base="ln")`` ->
    out ``[T, H, Dv]``, lse ``[T, H]``.

The plans are made once per step from the step's host mirrors of the metadata tensors
(mlagraph.ops.host_plan), and re-planned before each replay of a captured decode graph.
"""

from __future__ import annotations

import functools

import torch

from .. import host_plan
from .._paged import effective_lens, mask_empty
from ..backends import hardware_problem
from . import CAPABILITIES, LIBRARY

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's suggested float workspace


def _flashinfer(op: str, like: torch.Tensor):
    problem = hardware_problem(CAPABILITIES, like.device)
    if problem:
        raise ValueError(f"flashinfer.{op}: {problem}")
    return LIBRARY.load()


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by every wrapper (kernels run in stream order)."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def mla_csr(table: torch.Tensor, lens: torch.Tensor, page_size: int, s_q: int):
    """Host block table [B, P] and effective lengths [B] -> FlashInfer's CSR metadata (int32 CPU):
    qo_indptr [B+1] (s_q per request), kv_indptr [B+1] pages, kv_indices [pages], kv_len_arr [B]."""
    batch = table.shape[0]
    n_pages = (lens.long() + page_size - 1) // page_size
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
    kv_indptr[1:] = n_pages.cumsum(0)
    keep = torch.arange(table.shape[1])[None, :] < n_pages[:, None]
    kv_indices = table[keep].to(torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s_q
    return qo_indptr, kv_indptr, kv_indices, lens.to(torch.int32)


class _MlaPlan:
    def __init__(self, fi, q_nope, kv_cache, block_table, seq_lens, softmax_scale):
        batch, s_q, heads, lat = q_nope.shape
        self.block_table, self.seq_lens, self.s_q = block_table, seq_lens, s_q
        self.page_size = kv_cache.shape[1]
        dev = q_nope.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
            _workspace(dev), use_cuda_graph=True, qo_indptr=torch.empty(batch + 1, **i32),
            kv_indptr=torch.empty(batch + 1, **i32), kv_indices=torch.empty(block_table.numel(), **i32),
            kv_len_arr=torch.empty(batch, **i32), backend="fa3")
        self.args = dict(num_heads=heads, head_dim_ckv=lat, head_dim_kpe=kv_cache.shape[2] - lat,
                         page_size=self.page_size, causal=s_q > 1, sm_scale=float(softmax_scale),
                         q_data_type=q_nope.dtype, kv_data_type=kv_cache.dtype, query_layout="split",
                         kv_cache_layout="split", lse_mode="basee")
        self.fi = fi
        self.empty = torch.empty(batch, dtype=torch.bool, device=dev)
        self.refresh(host_plan.current())

    def refresh(self, step) -> None:
        table = host_plan.host_value("flashinfer.mla_decode", self.block_table, step)
        lens = effective_lens(table, host_plan.host_value("flashinfer.mla_decode", self.seq_lens, step), self.page_size)
        metadata = self.fi.mla.MLAPlanMetadata.csr(*mla_csr(table, lens, self.page_size, self.s_q))
        self.wrapper.plan(metadata=metadata, **self.args)
        # on the device, so a captured graph reads this step's mask
        self.empty.copy_(effective_lens(self.block_table, self.seq_lens, self.page_size) == 0)


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale):
    """Returns (out [B, s_q, H, L], lse [B, s_q, H] float32)."""
    fi = _flashinfer("mla_decode", q_nope)
    batch, s_q, heads, lat = q_nope.shape
    if batch == 0:
        return q_nope.new_empty(q_nope.shape), q_nope.new_empty((0, s_q, heads), dtype=torch.float32)
    key = ("flashinfer.mla_decode", host_plan.tensor_key(block_table), host_plan.tensor_key(seq_lens), s_q, heads,
           lat, kv_cache.shape[1], q_nope.dtype, float(softmax_scale))
    plan = host_plan.plan(key, lambda _s: _MlaPlan(fi, q_nope, kv_cache, block_table, seq_lens, softmax_scale),
                          _MlaPlan.refresh)
    # The compiled graph may hand q's halves over as views of other buffers (eliminate_concat
    # lets Inductor pass them as they are); fa3 gets them dense, as it always did.
    out, lse = plan.wrapper.run(
        query=(q_nope.reshape(batch * s_q, heads, lat).contiguous(), q_pe.reshape(batch * s_q, heads, -1).contiguous()),
        kv_cache=(kv_cache[..., :lat], kv_cache[..., lat:]), return_lse=True, return_lse_base_on_e=True)
    return mask_empty(out.view(batch, s_q, heads, lat), lse.view(batch, s_q, heads), plan.empty)


def _prefill_plan(fi, q, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend="fa3")
    wrapper.plan(host_plan.host_value("flashinfer.mha_prefill", cu_seqlens_q),
                 host_plan.host_value("flashinfer.mha_prefill", cu_seqlens_k), q.shape[1], q.shape[1], q.shape[2],
                 head_dim_vo=v.shape[2], causal=causal, sm_scale=float(softmax_scale), q_data_type=q.dtype)
    return wrapper


def mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request=False):
    """Returns (out [T, H, Dv], lse [T, H] float32)."""
    fi = _flashinfer("mha_prefill", q)
    if q.shape[0] == 0:
        return q.new_empty((0, q.shape[1], v.shape[2])), q.new_empty((0, q.shape[1]), dtype=torch.float32)
    key = ("flashinfer.mha_prefill", host_plan.tensor_key(cu_seqlens_q), host_plan.tensor_key(cu_seqlens_k),
           tuple(q.shape[1:]), v.shape[2], q.dtype, float(softmax_scale), causal)
    wrapper = host_plan.plan(key, lambda _s: _prefill_plan(fi, q, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal))
    # k and v come from slicing one projection: fa3 reads them through their strides
    out, lse = wrapper.run(q, k, v, return_lse=True, lse_base="ln")
    return out, lse
