"""The ``triton`` backend: mlagraph's own Triton kernels behind the generic MLA ops.

Each generic op ``mlagraph::<op>`` gets a twin ``mlagraph_triton::<op>`` with the same schema,
the same argument checks (so the same errors, eagerly and under fake tensors) and the same fake
kernel; only the implementation differs. V4's MoE and window-cache write have no kernel of
ours: the capability table declares that they use the reference op.

Kernel modules are imported on the first call, so ``import mlagraph`` never needs Triton and
reading the capability table costs nothing:

- :mod:`.rope_cache` ``rope``, ``latent_cache_write``, ``latent_cache_read``,
  ``fused_rope_concat_cache_write``
- :mod:`.decode`     ``mla_decode`` (split-KV over the paged cache, fixed grid)
- :mod:`.prefill`    ``mha_prefill`` (ragged causal flash attention with prefix)
- :mod:`.sparse`     ``sparse_mla``
- :mod:`.indexer`    ``indexer_cache_write``, ``indexer_topk``, ``csa_indexer_topk`` (V4's, same kernels)
- :mod:`.sink_attention` ``swa_decode``, ``hca_decode``, ``csa_decode`` and the prefill forms
  ``swa_attention``, ``hca_attention``, ``csa_attention`` (DeepSeek-V4's attentions, one kernel)
- :mod:`.compressor` ``compressor_update`` (DeepSeek-V4's compressors: state rows, pooled entries)
- :mod:`.moe`        ``moe`` (decode-sized batches: one GEMV launch per projection over the routed
  pairs, no sort; larger batches: the generic op's grouped GEMMs)

Kernels run on CUDA tensors. CPU tensors run through Triton's interpreter, which Triton turns on
for kernels defined while ``TRITON_INTERPRET=1`` is set (the CPU test suite sets it); without
it a CPU call raises a ValueError saying so.
"""

from __future__ import annotations

import importlib.util

# Aliased: the kernel modules below share these names (mlagraph.ops.triton.decode is ours).
from .. import cache as _cache, decode as _decode, indexer as _indexer, prefill as _prefill, rope as _rope
from .. import compressor as _compressor, moe as _moe, sparse as _sparse, swa as _swa, swa_decode as _swa_decode
from ..backends import GENERIC_OPS, V4_OPS, Backend, Capabilities, op_names_for, register
from ..twins import define_twin

NAMESPACE = "mlagraph_triton"

# generic op -> (kernel module, the generic op's argument check, its fake kernel)
_OPS = {
    "rope": ("rope_cache", lambda q_pe, k_pe, positions, cos_sin_cache, interleaved: _rope._check_rope(
        "rope", q_pe, k_pe, positions, cos_sin_cache), _rope.rope_fake),
    "latent_cache_write": ("rope_cache", lambda kv_c, k_pe, kv_cache, slot_mapping, scale, layout:
                           _cache._check_latent_cache_write("latent_cache_write", kv_c, k_pe, kv_cache,
                                                           slot_mapping, scale, layout),
                           _cache.latent_cache_write_fake),
    "latent_cache_read": ("rope_cache", _cache._check_latent_cache_read, _cache.latent_cache_read_fake),
    "fused_rope_concat_cache_write": ("rope_cache", lambda *args: _cache._check_fused(*args[:10]),
                                      _cache.fused_rope_concat_cache_write_fake),
    "mla_decode": ("decode", _decode._check_mla_decode, _decode.mla_decode_fake),
    "mha_prefill": ("prefill", _prefill._check_mha_prefill, _prefill.mha_prefill_fake),
    "sparse_mla": ("sparse", _sparse._check_sparse_mla, _sparse.sparse_mla_fake),
    "indexer_cache_write": ("indexer", _indexer._check_indexer_cache_write, _indexer.indexer_cache_write_fake),
    "indexer_topk": ("indexer", _indexer._check_indexer_topk, _indexer.indexer_topk_fake),
    "swa_decode": ("sink_attention", _swa_decode.check_swa_decode, _swa_decode.swa_decode_fake),
    "hca_decode": ("sink_attention", _swa_decode.check_hca_decode, _swa_decode.hca_decode_fake),
    "csa_decode": ("sink_attention", _swa_decode.check_csa_decode, _swa_decode.csa_decode_fake),
    "swa_attention": ("sink_attention", _swa._check_swa, _swa._swa_attention_fake),
    "hca_attention": ("sink_attention", _swa._check_hca, _swa._hca_attention_fake),
    "csa_attention": ("sink_attention", _swa._check_csa, _swa._csa_attention_fake),
    "compressor_update": ("compressor", _compressor._check_compressor, _compressor._compressor_update_fake),
    "csa_indexer_topk": ("indexer", _compressor._check_indexer, _compressor._csa_indexer_topk_fake),
    "moe": ("moe", _moe.check_moe_call, _moe.moe_fake),
}


for _generic, (_module, _check, _fake) in _OPS.items():
    define_twin(NAMESPACE, _generic, _check, _fake, f"{__name__}.{_module}")

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
# No kernel of ours: the reference op (V4's MoE and window-cache write).
_FALLBACKS = {g: "reference" for g in V4_OPS if g not in _OPS}

TRITON = register(
    Backend(
        name="triton",
        capabilities=Capabilities(
            latent_layouts=frozenset({"bf16", "fp8", "fp8_ds"}),
            indexer_layouts=frozenset({"bf16", "fp8"}),
            # One kernel rotates q_pe and k_pe, writes q = [q_nope | q_rot] and the cache row,
            # and returns the rotated K: nothing downstream has to care that it was fused.
            fused_rope_cache=True,
            fused_applies_rope=True,
            fused_writes_cache=True,
            fused_returns_k=True,
            decode_q_split=True,
            multi_token_decode=True,
            mha_prefill=True,
            mha_over_prefix=True,
            sparse_mla=True,
            # Fixed grids sized from shapes only, no host syncs, no allocation that depends on data.
            cuda_graph_safe=frozenset(GENERIC_OPS),
            # One request without a prefix: cuDNN's fused attention (mha_prefill's single_request).
            dense_prefill_sdpa=True,
            # Its fused kernel takes any latent width: V4's window rows (448 + 64) too.
            fused_rope_window_write=True,
            fallbacks=_FALLBACKS,
        ),
        op_names=op_names_for(NAMESPACE, _OPS, _FALLBACKS),
        available=_HAVE_TRITON,
        reason="" if _HAVE_TRITON else "the 'triton' package is not installed (pip install triton)",
    )
)
