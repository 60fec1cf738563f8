"""The ``flashmla`` backend: FlashMLA's SM90 kernels (PyPI ``sgl-flash-mla``) behind the generic ops.

``sgl-flash-mla`` installs the module ``flash_mla`` with two extensions: ``torch.ops.flash_mla``
(the current kernels, SM100 only) and ``torch.ops.flash_mla_legacy`` (Hopper, dense decode and
DeepSeek-V3.2's 656-byte cache rows). Every call here passes ``use_legacy=True``: this backend
is for SM90 (``Capabilities.sm``). Two generic ops run FlashMLA's kernels (:mod:`.kernels`):

- ``mla_decode``: layout ``bf16`` -> dense decode (pages of 64 tokens only, q joined
  ``[B, s_q, H, 576]``, causal within the s_q new tokens); layout ``fp8_ds`` -> the sparse fp8
  decode kernel over every visible position (dense == sparse when every key is listed), which
  is how a V3.2 model's short requests decode on this backend.
- ``sparse_mla``: ``bf16`` -> the sparse prefill kernel over the flat cache rows;
  ``fp8_ds`` -> the sparse fp8 decode kernel, one query per token. Both take 64 or 128 heads.

Every other generic op is a declared fallback (triton; V4's MoE and window write: reference), so the fusion
pass targets triton's fused RoPE + cache write, which writes both layouts. The twins run the
generic checks plus what FlashMLA cannot take (a ValueError naming the argument, eagerly and
under fake tensors). Registered whether or not the package is installed.
"""

from __future__ import annotations

from .. import decode as _decode, sparse as _sparse
from .._checks import fail
from .._library import Library
from ..backends import GENERIC_OPS, Backend, Capabilities, library_fallbacks, op_names_for, register
from ..twins import define_twin
from .. import triton as _triton  # noqa: F401  (registered first: flashmla falls back to it)

NAMESPACE = "mlagraph_flashmla"
LIBRARY = Library(
    package="sgl-flash-mla", module="flash_mla",
    install="install it with `pip install mlagraph[flashmla]` (or `pip install sgl-flash-mla`; on torch < 2.14.1 "
            "add --no-deps, see the README)")
PAGE_SIZE = 64  # the dense decode kernel's only page size
LATENT, ROPE = 512, 64  # head_dim_v and the rope part: FlashMLA's kernels are built for 576 = 512 + 64
SPARSE_HEADS = (64, 128)  # the sparse kernels' instantiations
LAYOUTS = ("bf16", "fp8_ds")


def _fail(op, arg, expected, got):
    fail(f"{NAMESPACE.split('_', 1)[1]}.{op}", arg, expected, got)


def _check_common(op, q_nope, q_pe, kv_cache, layout, heads_dim) -> None:
    # What FlashMLA's kernels cannot take, stated on shapes and dtypes so the fake raises it
    # too. The device (an sm_90 GPU) is checked by the kernels (.kernels), where it is real.
    import torch

    if q_nope.dtype != torch.bfloat16:
        _fail(op, "q_nope", "dtype bfloat16 (FlashMLA's kernels are built for bf16 queries)", str(q_nope.dtype))
    if q_nope.shape[-1] != LATENT or q_pe.shape[-1] != ROPE:
        _fail(op, "q_nope", f"latent width {LATENT} and rope width {ROPE} (FlashMLA is built for DeepSeek's 576)",
              f"{q_nope.shape[-1]} and {q_pe.shape[-1]}")
    if layout not in LAYOUTS:
        _fail(op, "layout", "'bf16' or 'fp8_ds' (FlashMLA has no per-tensor fp8 kernel for this cache)", repr(layout))
    if layout == "bf16" and kv_cache.dtype != torch.bfloat16:
        _fail(op, "kv_cache", "dtype bfloat16 for layout 'bf16'", str(kv_cache.dtype))


def _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale) -> None:
    _decode._check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)
    _check_common("mla_decode", q_nope, q_pe, kv_cache, layout, 3)
    if layout == "bf16" and kv_cache.shape[1] != PAGE_SIZE:
        _fail("mla_decode", "kv_cache", f"pages of {PAGE_SIZE} tokens, shape [*, {PAGE_SIZE}, 576] (FlashMLA's dense "
              f"decode; Engine(page_size={PAGE_SIZE}))", f"shape {list(kv_cache.shape)}")
    if layout == "fp8_ds" and q_nope.shape[2] not in SPARSE_HEADS:
        _fail("mla_decode", "q_nope", f"{' or '.join(map(str, SPARSE_HEADS))} heads for layout 'fp8_ds' (FlashMLA's "
              "sparse fp8 kernel)", f"shape {list(q_nope.shape)}")


def _mla_decode_fake(*args):
    _check_mla_decode(*args)
    return _decode.mla_decode_fake(*args)


def _check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout, softmax_scale):
    _sparse._check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, scale, layout,
                              softmax_scale)
    _check_common("sparse_mla", q_nope, q_pe, kv_cache, layout, 2)
    if q_nope.shape[1] not in SPARSE_HEADS:
        _fail("sparse_mla", "q_nope", f"{' or '.join(map(str, SPARSE_HEADS))} heads (FlashMLA's sparse kernels)",
              f"shape {list(q_nope.shape)}")


def _sparse_mla_fake(*args):
    _check_sparse_mla(*args)
    return _sparse.sparse_mla_fake(*args)


# generic op -> (argument check, fake kernel); the implementation is .kernels.<op>
_OPS = {
    "mla_decode": (_check_mla_decode, _mla_decode_fake),
    "sparse_mla": (_check_sparse_mla, _sparse_mla_fake),
}
for _generic, (_check, _fake) in _OPS.items():
    define_twin(NAMESPACE, _generic, _check, _fake, f"{__name__}.kernels")

FALLBACKS = library_fallbacks(_OPS)

CAPABILITIES = Capabilities(
    latent_layouts=frozenset(LAYOUTS),  # both decode paths; triton's writer writes both
    indexer_layouts=frozenset({"bf16", "fp8"}),  # triton's indexer ops
    # triton's fused RoPE + concat + cache write (a declared fallback): it rotates, writes, returns K
    fused_rope_cache=True,
    fused_applies_rope=True,
    fused_writes_cache=True,
    fused_returns_k=True,
    decode_q_split=False,  # FlashMLA reads q joined [.., 576]: the fused op's q is read in place
    multi_token_decode=True,  # dense decode is causal within the s_q new tokens; sparse lists per query
    mha_prefill=True,  # triton's
    mha_over_prefix=True,  # triton's
    sparse_mla=True,
    # Both kernels take their metadata on the device (the tile scheduler reads seq_lens there),
    # shapes from the inputs' shapes: capturable. The fallbacks are triton's and reference's.
    cuda_graph_safe=frozenset(GENERIC_OPS),
    dense_prefill_sdpa=True,  # triton's prefill, with the single-request cuDNN path
    fallbacks=FALLBACKS,
    page_sizes=frozenset({PAGE_SIZE}),
    head_dims={"mla_decode": {(LATENT + ROPE, LATENT)}, "sparse_mla": {(LATENT + ROPE, LATENT)}},
    # the sparse kernels (sparse_mla, and mla_decode over fp8_ds rows) are instantiated for 64 and 128 heads
    head_counts={"sparse_mla": SPARSE_HEADS, "mla_decode[fp8_ds]": SPARSE_HEADS},
    preferred_page_size=PAGE_SIZE,
    sm=frozenset({90}),  # the legacy (Hopper) extension; the current one is SM100 and V4.1-only
    step_metadata=True,  # tile-scheduler metadata once per step, shared by every layer
)

OP_NAMES = op_names_for(NAMESPACE, _OPS, FALLBACKS)


def make_backend() -> Backend:
    ok, why = LIBRARY.available()
    return Backend(name="flashmla", capabilities=CAPABILITIES, op_names=OP_NAMES, available=ok,
                   reason="" if ok else why)


FLASHMLA = register(make_backend())
