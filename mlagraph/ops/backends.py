"""Backends: which implementation of each MLA op a model runs, and what each one can do.

A backend is a name, a frozen :class:`Capabilities` table and a map from each generic op name
(``"mla_decode"``, ``"mha_prefill"``, ...) to the ``torch.ops`` op that implements it. Every
dispatch decision in mlagraph (the forward method of a layer, which fusion a pass applies) is a
pure function of that table and the batch plan: no environment variable, platform flag or
module-level switch reaches an op, a pass or a dispatch function (docs/design.md, rules 1-4).

    >>> from mlagraph.ops import backends
    >>> backends.names()
    ['reference', 'triton', 'aiter']
    >>> backends.get("triton").capabilities.fused_returns_k
    True
    >>> backends.get("cuda")
    Traceback (most recent call last):
    ValueError: unknown backend 'cuda'; known backends: reference, triton, aiter
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch

# DeepSeek-V4's attention, compressors and MoE (mlagraph.ops.swa, .swa_decode, .compressor, .moe_v4).
V4_OPS = (
    "swa_cache_write",
    "swa_attention",
    "hca_attention",
    "csa_attention",
    "swa_decode",
    "hca_decode",
    "csa_decode",
    "compressor_update",
    "csa_indexer_topk",
    "v4_moe",
)

# The generic ops every backend provides (its own kernel, or a declared fallback).
GENERIC_OPS = (
    "rope",
    "latent_cache_write",
    "latent_cache_read",
    "fused_rope_concat_cache_write",
    "mla_decode",
    "mha_prefill",
    "sparse_mla",
    "indexer_cache_write",
    "indexer_topk",
    "moe",
) + V4_OPS


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend's kernels do, stated once. Read by dispatch and by the graph passes.

    Attributes:
        latent_layouts: latent cache layouts its kernels read and write.
        indexer_layouts: indexer-key cache layouts (DSA) it reads and writes; a V3.2 model on
            this backend is refused when its indexer layout is not among them.
        fused_rope_cache: it has a single op for RoPE -> concat(q) -> latent cache write.
        fused_applies_rope: that fused op rotates q_pe and k_pe itself (so nothing else may).
        fused_writes_cache: that fused op writes the latent cache itself.
        fused_returns_k: that fused op returns the rotated k_pe; if False its K output is an
            empty tensor and no consumer may read it.
        decode_q_split: its decode takes q_nope and q_pe as two tensors (no concat needed).
        multi_token_decode: its decode takes s_q > 1 (causal within the new tokens).
        mha_prefill: it has dense ragged MHA prefill (q/k 192, v 128 for DeepSeek).
        mha_over_prefix: its MHA prefill takes keys = cached prefix + new tokens.
        sparse_mla: it has DSA sparse attention over top-k indices.
        dense_prefill_sdpa: its ``mha_prefill`` runs torch SDPA's cuDNN kernel when the caller
            passes ``single_request=True`` (one request, no prefix, no padding); the batch
            builder sets that flag, and skips padding such a batch, only for these backends.
        cuda_graph_safe: generic ops whose kernels are safe to capture in a CUDA graph.
        fused_rope_window_write: its fused op also serves DeepSeek-V4's front (``bf16`` rows of
            D - R plain values and R rotated ones: the window cache), so the passes fuse V4's
            RoPE + window write into it (mlagraph.passes.fusion_v4).
        fallbacks: generic op -> backend whose implementation this backend uses for it. Declared
            here once: :func:`op_names_for` derives the op map from it, :func:`register` checks it.
    """

    latent_layouts: frozenset[str]
    indexer_layouts: frozenset[str]
    fused_rope_cache: bool
    fused_applies_rope: bool
    fused_writes_cache: bool
    fused_returns_k: bool
    decode_q_split: bool
    multi_token_decode: bool
    mha_prefill: bool
    mha_over_prefix: bool
    sparse_mla: bool
    cuda_graph_safe: frozenset[str]
    dense_prefill_sdpa: bool = False
    fused_rope_window_write: bool = False
    fallbacks: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        # Freeze the mapping so a table can never be edited after registration.
        object.__setattr__(self, "fallbacks", MappingProxyType(dict(self.fallbacks)))


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend. ``op(name)`` returns the ``torch.ops`` packet for a generic op."""

    name: str
    capabilities: Capabilities
    op_names: Mapping[str, str]  # generic op -> "namespace::op"
    available: bool = True
    reason: str = ""  # why it is unavailable, and how to fix that

    def op(self, generic: str) -> torch._ops.OpOverloadPacket:
        if generic not in self.op_names:
            raise ValueError(
                f"backend {self.name!r}: no op {generic!r}; expected one of {sorted(self.op_names)}"
            )
        namespace, name = self.op_names[generic].split("::")
        return getattr(getattr(torch.ops, namespace), name)

    def owned_ops(self) -> frozenset[str]:
        """Qualified names of ops private to this backend: not in the shared ``mlagraph`` set,
        and not another backend's op it maps as a declared fallback (aiter maps seven of
        triton's; they stay triton's, or a triton graph would look like aiter's too)."""
        fallbacks = self.capabilities.fallbacks
        return frozenset(q for g, q in self.op_names.items() if g not in fallbacks and not q.startswith("mlagraph::"))


_REGISTRY: dict[str, Backend] = {}


def op_names_for(namespace: str, own: Iterable[str], fallbacks: Mapping[str, str]) -> dict[str, str]:
    """A backend's op map: each op it implements as ``namespace::<op>``, each declared fallback
    as the op of the (registered) backend it names."""
    names = {g: f"{namespace}::{g}" for g in own}
    for g, other in fallbacks.items():
        if other not in _REGISTRY:
            raise ValueError(f"fallbacks: {g!r} falls back to {other!r}, which is not registered")
        names[g] = _REGISTRY[other].op_names[g]
    return names


def register(backend: Backend) -> Backend:
    """Adds ``backend`` to the registry after checking that it maps every generic op and that
    each declared fallback is the named backend's op."""
    missing = [g for g in GENERIC_OPS if g not in backend.op_names]
    if missing:
        raise ValueError(f"backend {backend.name!r} does not map generic ops {missing}")
    for g, other in backend.capabilities.fallbacks.items():
        want = _REGISTRY[other].op_names.get(g) if other in _REGISTRY else None
        if backend.op_names[g] != want:
            raise ValueError(
                f"backend {backend.name!r}: fallbacks: {g!r} is declared to run backend {other!r}'s op "
                f"({want or 'not registered'}), but maps to {backend.op_names[g]}"
            )
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> Backend:
    """Removes a registered backend and returns it (tests use it to undo a ``register``).

    The registry is process-wide, and the graph lints and the compiler read all of it (an op
    private to any registered backend is foreign in every other backend's graph), so a backend
    registered for one test must be removed after it. ``"reference"`` cannot be removed.
    """
    if name == "reference":
        raise ValueError("unregister: the 'reference' backend cannot be removed")
    if name not in _REGISTRY:
        raise ValueError(f"unregister: unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}")
    return _REGISTRY.pop(name)


def registered() -> list[Backend]:
    """Every registered backend, available or not (graph lints check all their private ops)."""
    return list(_REGISTRY.values())


def names() -> list[str]:
    """Names of all registered backends (available or not), in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Backend:
    """The backend called ``name``; ValueError listing the known names if there is none.

    A registered but unavailable backend (say, ``aiter`` without its wheel) raises too, with
    the reason and how to install what it needs.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}")
    backend = _REGISTRY[name]
    if not backend.available:
        raise ValueError(f"backend {name!r} is not available: {backend.reason}")
    return backend


REFERENCE = register(
    Backend(
        name="reference",
        capabilities=Capabilities(
            latent_layouts=frozenset({"bf16", "fp8", "fp8_ds"}),
            indexer_layouts=frozenset({"bf16", "fp8"}),
            fused_rope_cache=True,
            fused_applies_rope=True,
            fused_writes_cache=True,
            fused_returns_k=True,
            decode_q_split=True,
            multi_token_decode=True,
            mha_prefill=True,
            mha_over_prefix=True,
            sparse_mla=True,
            # Plain PyTorch with no host syncs and no data-dependent shapes: capturable, if slow.
            cuda_graph_safe=frozenset(GENERIC_OPS),
            fused_rope_window_write=True,
        ),
        op_names={g: f"mlagraph::{g}" for g in GENERIC_OPS},
    )
)
