"""The ``aiter`` backend: AMD aiter's Triton MLA kernels behind the generic ops, with their real contracts.

aiter (PyPI ``amd-aiter``) has two Triton kernels this backend uses; every other generic op is
a DECLARED fallback (``Capabilities.fallbacks``) to the triton backend's op (V4's MoE and
window-cache write: the reference op), mapped in ``op_names``, so nothing is decided at run time:

- ``mlagraph_aiter::fused_rope_concat_cache_write``: aiter's ``fused_qk_rope_cat_and_cache_mla``.
  It rotates q_pe and k_pe itself, writes the latent cache itself and returns q; its K output
  is an EMPTY tensor of shape ``[0]`` (``fused_returns_k=False``): aiter's own k_pe output is
  written only for tokens with a slot, so it is not handed on. The fusion pass therefore
  leaves a layer unfused when something besides the cache write reads the rotated K (plain MHA
  prefill builds its keys from it), and ``lint_backend_ops`` rejects any graph that reads it.
  Cache layouts ``bf16`` and ``fp8``; not ``fp8_ds``.
- ``mlagraph_aiter::mla_decode``: aiter's ``decode_attention_fwd_grouped_rope``, which reads q
  CONCATENATED (``decode_q_split=False``: the fusion's q is read in place, no concat to
  eliminate), one query per request (``multi_token_decode=False``: verify steps run MHA over
  the cached prefix instead), and unquantized caches only (no scale input). Metadata, padding
  requests (out 0, never aiter's NaN) and the lse are handled around it on the device, see
  :mod:`.kernels`.

So the table's ``latent_layouts`` is ``{"bf16"}``: a model on this backend must be able to
decode what it writes, and aiter's decode reads no ``fp8`` cache (the fused op alone also
writes ``fp8``; tested as an op).

Each op twin has the generic op's schema and runs the generic op's argument checks, plus the
checks for what aiter's kernel cannot take (a ValueError naming the argument, eagerly and
under fake tensors). The ops are defined and the backend is registered whether or not
amd-aiter is installed (``import mlagraph`` never needs it); without it the backend is listed
as unavailable with the reason, and ``backends.get("aiter")`` raises saying how to install it.
aiter's kernels are plain Triton: they run on NVIDIA GPUs, and on CPU tensors through Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before they are first loaded.

:func:`load` and :func:`available` (the loader, :mod:`._loader`) are re-exported here.
"""

from __future__ import annotations

from .. import cache as _cache, decode as _decode
from ..backends import GENERIC_OPS, Backend, Capabilities, library_fallbacks, op_names_for, register
from ..twins import define_twin
from .. import triton as _triton  # noqa: F401  (registered first: aiter falls back to it)
from ._loader import INSTALL_HINT, PACKAGE, available, load

__all__ = ["AITER", "CAPABILITIES", "EMPTY_K_SHAPE", "FALLBACKS", "INSTALL_HINT", "NAMESPACE", "OP_NAMES", "PACKAGE",
           "available", "load", "make_backend"]

NAMESPACE = "mlagraph_aiter"
FUSED_LAYOUTS = ("bf16", "fp8")
EMPTY_K_SHAPE = (0,)  # the fused op's K output: aiter returns no usable K (fused_returns_k=False)


def _fail(op: str, arg: str, expected: str, got: object) -> None:
    raise ValueError(f"{NAMESPACE}.{op}: argument '{arg}': expected {expected}, got {got}")


def _pow2(n) -> bool:
    n = int(n)
    return n > 0 and n & (n - 1) == 0


def _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout,
                 interleaved) -> None:
    _cache._check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout)
    op = "fused_rope_concat_cache_write"
    if layout not in FUSED_LAYOUTS:
        _fail(op, "layout", "'bf16' or 'fp8' (aiter's fused op has no per-group scales)", repr(layout))
    # aiter's kernel loads each row part with tl.arange over its full width.
    for arg, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_c", kv_c)):
        if not _pow2(t.shape[-1]):
            _fail(op, arg, "a last dim that is a power of two (aiter's kernel loads it whole)",
                  f"shape {list(t.shape)}")


def _fused_fake(*args):
    _check_fused(*args)
    q_nope, q_pe, k_pe = args[0], args[1], args[3]
    t, h, dn = q_nope.shape
    return q_nope.new_empty((t, h, dn + q_pe.shape[2])), k_pe.new_empty(EMPTY_K_SHAPE)


def _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale) -> None:
    _decode._check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)
    op = "mla_decode"
    if q_nope.shape[1] != 1:
        _fail(op, "q_nope", "s_q == 1, shape [B, 1, H, L] (aiter's decode has no multi-token causal mode; "
              "the table says multi_token_decode=False)", f"shape {list(q_nope.shape)}")
    if layout != "bf16":
        _fail(op, "layout", "'bf16' (aiter's decode reads unquantized caches only)", repr(layout))
    if kv_cache.dtype != q_nope.dtype:
        _fail(op, "kv_cache", f"the dtype of 'q_nope' ({q_nope.dtype}): aiter's dots take one dtype",
              str(kv_cache.dtype))
    if kv_cache.shape[1] > 0 and kv_cache.shape[2] > 1 and kv_cache.stride(2) != 1:
        _fail(op, "kv_cache", "rows with unit stride (aiter reads them so)", f"strides {list(kv_cache.stride())}")


def _mla_decode_fake(*args):
    _check_mla_decode(*args)
    return _decode.mla_decode_fake(*args)


# generic op -> (argument check, fake kernel); the implementation is mlagraph.ops.aiter.kernels.<op>
_OPS = {
    "fused_rope_concat_cache_write": (_check_fused, _fused_fake),
    "mla_decode": (_check_mla_decode, _mla_decode_fake),
}


for _generic, (_check, _fake) in _OPS.items():
    define_twin(NAMESPACE, _generic, _check, _fake, f"{__name__}.kernels")

# Every generic op without an aiter kernel, and the backend whose op it runs.
FALLBACKS = library_fallbacks(_OPS)

CAPABILITIES = Capabilities(
    # aiter's decode reads unquantized rows only (no scale input): the only layout a model on
    # this backend can both write and read.
    latent_layouts=frozenset({"bf16"}),
    indexer_layouts=frozenset({"bf16", "fp8"}),  # triton's indexer ops
    fused_rope_cache=True,
    fused_applies_rope=True,  # it rotates q_pe and k_pe itself: nothing else may
    fused_writes_cache=True,  # it writes the latent cache itself
    fused_returns_k=False,  # its K output is empty ([0]): no consumer may read it
    decode_q_split=False,  # q concatenated [B, H, L + R], unit last stride
    multi_token_decode=False,  # s_q == 1 only
    mha_prefill=True,  # triton's
    mha_over_prefix=True,  # triton's
    sparse_mla=True,  # triton's
    # fused op: aiter's host wrapper only allocates (torch.empty, sizes from shapes) and
    # launches a grid fixed by shapes. decode: the metadata, output masking and lse are device
    # ops with shapes fixed by the inputs' shapes, no host reads (tests run it under a
    # host-sync detector); aiter's kernels compile once per batch size (warm up before
    # capture). The fallbacks are the triton and reference ops, both capturable.
    cuda_graph_safe=frozenset(GENERIC_OPS),
    dense_prefill_sdpa=True,  # its mha_prefill is triton's, which has the single-request cuDNN path
    fallbacks=FALLBACKS,
)

OP_NAMES = op_names_for(NAMESPACE, _OPS, FALLBACKS)


def make_backend() -> Backend:
    """The ``aiter`` Backend, available or not as amd-aiter's installation says right now."""
    ok, why = available()
    return Backend(name="aiter", capabilities=CAPABILITIES, op_names=OP_NAMES, available=ok,
                        reason="" if ok else why)


AITER = register(make_backend())
