"""The ``flashinfer`` backend: FlashInfer's fa3 kernels (PyPI ``flashinfer-python``) behind the generic ops.

Two generic ops run FlashInfer's kernels (:mod:`.kernels`), each after a host-side ``plan()``
made once per step from the batch's host metadata (mlagraph.ops.host_plan):

- ``mla_decode``: ``BatchMLAPagedAttentionWrapper`` (backend "fa3"), q split (q_nope, q_pe),
  the cache read as two strided views (ckv ``[..., :512]``, kpe ``[..., 512:]``) of our one
  ``[pages, page, 576]`` bf16 cache: no copy. Any page size; s_q > 1 causal.
- ``mha_prefill``: ``BatchPrefillWithRaggedKVCacheWrapper`` (fa3), ragged causal attention with
  q/k 192 and v 128, keys = cached prefix + new tokens.

Every other generic op is a declared fallback to triton's (V4's MoE and window write: reference), the fused
RoPE + cache write included: the fusion pass targets triton's fused op on this backend.
FlashInfer's own RoPE / RoPE + quantize / paged MLA append helpers are not mapped: for a bf16
cache they are two kernels and a concat against triton's one (docs/design.md). Registered whether or not the package is installed.
"""

from __future__ import annotations

import torch

from .. import decode as _decode, prefill as _prefill
from .._checks import fail
from .._library import Library
from ..backends import GENERIC_OPS, Backend, Capabilities, library_fallbacks, op_names_for, register
from ..twins import define_twin
from .. import triton as _triton  # noqa: F401  (registered first: flashinfer falls back to it)

NAMESPACE = "mlagraph_flashinfer"
LIBRARY = Library(
    package="flashinfer-python", module="flashinfer",
    install="install it with `pip install mlagraph[flashinfer]` (or `pip install flashinfer-python "
            "apache-tvm-ffi`); it JIT-compiles its kernels on first use, which needs the CUDA toolkit")
DTYPES = (torch.bfloat16, torch.float16)  # fa3's query / cache dtypes
LATENT, ROPE = 512, 64  # its MLA kernel is built for head_dim_ckv 512 and head_dim_kpe 64
# fa3's ragged prefill instantiations (include/flashinfer/attention/hopper/prefill_sm90.cuh):
# equal widths of 64, 128 or 256, or DeepSeek's 192 / 128; other widths fail its JIT build.
PREFILL_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


def _fail(op, arg, expected, got):
    fail(f"flashinfer.{op}", arg, expected, got)


def _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale) -> None:
    _decode._check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)
    if q_nope.dtype not in DTYPES:
        _fail("mla_decode", "q_nope", "dtype bfloat16 or float16 (FlashInfer's fa3 MLA)", str(q_nope.dtype))
    if layout != "bf16":
        _fail("mla_decode", "layout", "'bf16' (this backend passes no fp8 scales to FlashInfer)", repr(layout))
    if kv_cache.dtype != q_nope.dtype:
        _fail("mla_decode", "kv_cache", f"the dtype of 'q_nope' ({q_nope.dtype})", str(kv_cache.dtype))
    if q_nope.shape[-1] != LATENT or q_pe.shape[-1] != ROPE:
        _fail("mla_decode", "q_nope", f"latent width {LATENT} and rope width {ROPE} (FlashInfer's MLA kernel)",
              f"{q_nope.shape[-1]} and {q_pe.shape[-1]}")


def _mla_decode_fake(*args):
    _check_mla_decode(*args)
    return _decode.mla_decode_fake(*args)


def _check_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request=False) -> None:
    _prefill._check_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, single_request)
    if q.dtype not in DTYPES:
        _fail("mha_prefill", "q", "dtype bfloat16 or float16 (FlashInfer's fa3 prefill)", str(q.dtype))
    if (q.shape[-1], v.shape[-1]) not in PREFILL_HEAD_DIMS:
        _fail("mha_prefill", "q", f"(q, v) head widths in {sorted(PREFILL_HEAD_DIMS)} (FlashInfer's fa3 prefill)",
              f"({q.shape[-1]}, {v.shape[-1]})")


def _mha_prefill_fake(*args):
    _check_mha_prefill(*args)
    return _prefill.mha_prefill_fake(*args)


_OPS = {
    "mla_decode": (_check_mla_decode, _mla_decode_fake),
    "mha_prefill": (_check_mha_prefill, _mha_prefill_fake),
}
for _generic, (_check, _fake) in _OPS.items():
    define_twin(NAMESPACE, _generic, _check, _fake, f"{__name__}.kernels")

FALLBACKS = library_fallbacks(_OPS)

CAPABILITIES = Capabilities(
    latent_layouts=frozenset({"bf16"}),  # its decode is given no fp8 scales
    indexer_layouts=frozenset({"bf16", "fp8"}),  # triton's
    fused_rope_cache=True,  # triton's fused op (a declared fallback): rotates, writes, returns K
    fused_applies_rope=True,
    fused_writes_cache=True,
    fused_returns_k=True,
    decode_q_split=True,  # run(query=(q_nope, q_pe)): no concat
    multi_token_decode=True,  # causal within the new tokens (qo_indptr of s_q per request)
    mha_prefill=True,
    mha_over_prefix=True,  # ragged: keys = prefix + new tokens, causal aligned at the end
    sparse_mla=True,  # triton's
    # mla_decode: planned on the host before capture and before every replay, into the
    # wrapper's own buffers (use_cuda_graph=True), then run() only launches. mha_prefill's plan
    # needs the step's host lengths too; prefill is never captured, and a capture without a
    # step's mirrors of cu_seqlens would raise (host_plan.host_value).
    cuda_graph_safe=frozenset(GENERIC_OPS),
    dense_prefill_sdpa=False,  # its ragged prefill beat cuDNN's dense kernel on the H200
    fallbacks=FALLBACKS,
    head_dims={"mla_decode": {(LATENT + ROPE, LATENT)}, "mha_prefill": PREFILL_HEAD_DIMS},
    sm=frozenset({90}),  # the fa3 kernels are Hopper's
    step_metadata=True,
)

OP_NAMES = op_names_for(NAMESPACE, _OPS, FALLBACKS)


def make_backend() -> Backend:
    ok, why = LIBRARY.available()
    return Backend(name="flashinfer", capabilities=CAPABILITIES, op_names=OP_NAMES, available=ok,
                   reason="" if ok else why)


FLASHINFER = register(make_backend())
