"""MLA operations as ``torch.ops.mlagraph.*`` custom ops, and the backends that implement them.

Importing this package registers every op. One module per op family holds its schema, its
argument checks (shared by the real and the fake kernel), its fake kernel and its reference
implementation in plain PyTorch:

- :mod:`.rope`     ``rope`` (+ :func:`rope_cos_sin_cache`, the YaRN cos/sin table)
- :mod:`.cache`    ``latent_cache_write``, ``latent_cache_read``, ``fused_rope_concat_cache_write``
- :mod:`.decode`   ``mla_decode`` (absorbed, paged)
- :mod:`.prefill`  ``mha_prefill`` (dense, ragged, causal with prefix)
- :mod:`.sparse`   ``sparse_mla`` (DSA attention over top-k indices)
- :mod:`.indexer`  ``indexer_cache_write``, ``indexer_topk``
- :mod:`.moe`      ``moe`` (DeepSeek routing + routed experts, grouped by expert)
- :mod:`.fp8`      ``fp8_linear`` (DeepSeek's block-scaled fp8 weights kept in fp8)
- :mod:`.swa`      ``swa_cache_write``, ``swa_attention``, ``hca_attention``, ``csa_attention`` (V4)
- :mod:`.swa_decode` ``swa_decode``, ``hca_decode``, ``csa_decode`` (V4, batch-major decode forms)
- :mod:`.compressor` ``compressor_update``, ``csa_indexer_topk`` (V4)
- :mod:`.moe_v4`   ``v4_moe`` (V4 routing: sqrtsoftplus, hash; clamped experts)

Cache layouts are described in :mod:`.layouts` (V4's in :mod:`.v4_layouts`); backends and their capability tables in
:mod:`.backends`; ``backend="auto"`` in :mod:`.auto`; per-step kernel metadata in :mod:`.host_plan`.
"""

from . import layouts  # noqa: F401
from . import rope, cache, decode, prefill, sparse, indexer, fp8, moe  # noqa: F401  (registers the ops)
from . import swa, swa_decode, compressor, moe_v4  # noqa: F401  (DeepSeek-V4's ops)
from . import backends  # noqa: F401
from . import triton  # noqa: F401  (registers the triton backend and its ops)
from . import aiter  # noqa: F401  (registers the aiter backend and its ops; amd-aiter optional)
from . import flashmla  # noqa: F401  (FlashMLA's SM90 kernels; sgl-flash-mla optional)
from . import flashinfer  # noqa: F401  (FlashInfer's fa3 kernels; flashinfer-python optional)
from .rope import rope_cos_sin_cache  # noqa: F401
