"""Backends: which implementation of each MLA op a model runs, and what each one can do.

A backend is a name, a frozen :class:`Capabilities` table and a map from each generic op name
(``"mla_decode"``, ``"mha_prefill"``, ...) to the ``torch.ops`` op that implements it. Every
dispatch decision in mlagraph (the forward method of a layer, which fusion a pass applies) is a
pure function of that table and the batch plan: no environment variable, platform flag or
module-level switch reaches an op, a pass or a dispatch function (docs/design.md, rules 1-4).

    >>> from mlagraph.ops import backends
    >>> backends.names()
    ['reference', 'triton', 'aiter', 'flashmla', 'flashinfer']
    >>> backends.get("triton").capabilities.fused_returns_k
    True
    >>> backends.get("cuda")
    Traceback (most recent call last):
    ValueError: unknown backend 'cuda'; known backends: reference, triton, aiter, flashmla, flashinfer, auto

``"auto"`` is not a table of its own: :func:`get` composes it, per device, from the registered
tables (:mod:`.auto`).
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
        page_sizes: the cache page sizes its kernels take (None: any). FlashMLA's dense decode
            reads pages of 64 tokens only.
        head_dims: generic op -> the (query/key, value) head widths its own kernel is built for
            (absent: any). For ``mha_prefill`` that is (qk_nope + qk_rope, v_head_dim), 192 and
            128 for DeepSeek; for ``mla_decode`` / ``sparse_mla`` (kv_lora_rank + qk_rope,
            kv_lora_rank), 576 and 512. A model whose widths are not listed is refused by an
            explicit backend and served by another backend's op under ``auto``.
        head_counts: generic op -> the query head counts its own kernel takes (absent: any);
            a key ``"op[layout]"`` limits the op under that cache layout only. FlashMLA's sparse
            kernels are built for 64 and 128 heads: a tensor-parallel shard of 16 is refused by
            an explicit ``flashmla`` (for the ops the model runs) and routed around by ``auto``.
        preferred_page_size: the Engine's page size when none is given (in ``page_sizes``).
        sm: the CUDA compute capabilities (major * 10 + minor) its own kernels run on; None: any
            device Triton or PyTorch runs on (CPU included, through the interpreter).
        step_metadata: its ops share metadata made once per step (FlashInfer's host ``plan()``,
            FlashMLA's tile scheduler) through :mod:`mlagraph.ops.host_plan`; the engine opens
            a step around every forward and re-plans before every CUDA-graph replay.
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
    page_sizes: frozenset[int] | None = None
    head_dims: Mapping[str, frozenset[tuple[int, int]]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    head_counts: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    preferred_page_size: int = 16
    sm: frozenset[int] | None = None
    step_metadata: bool = False

    def __post_init__(self) -> None:
        # Freeze the mapping so a table can never be edited after registration.
        object.__setattr__(self, "fallbacks", MappingProxyType(dict(self.fallbacks)))
        object.__setattr__(self, "head_dims", MappingProxyType({g: frozenset(d) for g, d in self.head_dims.items()}))
        object.__setattr__(self, "head_counts",
                           MappingProxyType({g: frozenset(n) for g, n in self.head_counts.items()}))
        if self.page_sizes is not None and self.preferred_page_size not in self.page_sizes:
            raise ValueError(f"Capabilities: preferred_page_size {self.preferred_page_size} is not in "
                             f"page_sizes {sorted(self.page_sizes)}")


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend. ``op(name)`` returns the ``torch.ops`` packet for a generic op."""

    name: str
    capabilities: Capabilities
    op_names: Mapping[str, str]  # generic op -> "namespace::op"
    available: bool = True
    reason: str = ""  # why it is unavailable, and how to fix that
    # Composed backends ("auto"): generic op -> the registered backend whose op it runs.
    parts: Mapping[str, str] | None = None

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
_COMPOSED: dict[str, Backend] = {}  # "auto" compositions made so far, by name (auto.py)


def library_fallbacks(own) -> dict[str, str]:
    """The fallbacks of a backend over a kernel library that has kernels for the ops ``own``:
    triton's op for every other generic op, or, where triton itself declares a fallback
    (DeepSeek-V4's MoE and window-cache write), the op it falls back to. aiter, flashmla and
    flashinfer share it; the triton backend must be registered first."""
    triton = _REGISTRY["triton"].capabilities.fallbacks
    return {g: triton.get(g, "triton") for g in GENERIC_OPS if g not in own}


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
    """Every registered backend, available or not (graph lints check all their private ops),
    then the ``auto`` compositions made so far (the compiler finds a model's backend by name)."""
    return list(_REGISTRY.values()) + list(_COMPOSED.values())


def names() -> list[str]:
    """Names of all registered backends (available or not), in registration order."""
    return list(_REGISTRY)


def head_dims_problem(caps: Capabilities, dims: Mapping[str, tuple[int, int]]) -> str:
    """Why a backend with table ``caps`` cannot run a model whose ops need the head widths
    ``dims`` (generic op -> (qk, v), see :attr:`Capabilities.head_dims`); "" if it can."""
    for op, want in dims.items():
        built = caps.head_dims.get(op)
        if built is not None and tuple(want) not in built:
            return (f"its {op} kernel is built for (qk, v) head widths {sorted(built)}, "
                    f"got {tuple(want)}")
    return ""


def head_counts_for(caps: Capabilities, op: str, layout: str) -> frozenset[int] | None:
    """The head counts ``op``'s own kernel takes under cache ``layout`` (None: any)."""
    return caps.head_counts.get(f"{op}[{layout}]", caps.head_counts.get(op))


def head_counts_problem(caps: Capabilities, heads: Mapping[str, int], layout: str) -> str:
    """Why a backend with table ``caps`` cannot run a model whose ops run ``heads`` query heads
    (generic op -> count, per rank) over cache ``layout``; "" if it can."""
    for op, n in heads.items():
        built = head_counts_for(caps, op, layout)
        if built is not None and n not in built:
            where = f" for layout {layout!r}" if f"{op}[{layout}]" in caps.head_counts else ""
            return f"its {op} kernel{where} takes {' or '.join(map(str, sorted(built)))} query heads, got {n}"
    return ""


def get(name: str, device: torch.device | str | None = None, layout: str = "bf16",
        dims: Mapping[str, tuple[int, int]] | None = None, heads: Mapping[str, int] | None = None) -> Backend:
    """The backend called ``name``; ValueError listing the known names if there is none.

    A registered but unavailable backend (say, ``aiter`` without its wheel, or ``flashmla`` on
    a machine without a Hopper GPU) raises too, with the reason and how to fix it.
    ``"auto"`` is composed for ``device`` (default: CUDA device 0 if there is one, else the CPU)
    and the latent cache ``layout`` (:func:`mlagraph.ops.auto.compose`); a composition's name
    (``"auto[...]"``, as a model's summary prints it) is accepted too. ``dims``, a model's head
    widths per op (:attr:`Capabilities.head_dims`), steers ``auto`` away from kernels not built
    for them and makes an explicit backend that is not raise; ``heads``, the query heads per
    op of the ops the model runs (per tensor-parallel rank, :attr:`Capabilities.head_counts`),
    does the same for head counts.
    """
    dims, heads = dims or {}, heads or {}
    if name == "auto":
        from .auto import resolve

        return resolve(device, layout, dims, heads)
    if isinstance(name, str) and name in _COMPOSED:
        backend = _COMPOSED[name]
    elif not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}, auto")
    else:
        backend = _REGISTRY[name]
        if not backend.available:
            raise ValueError(f"backend {name!r} is not available: {backend.reason}")
        problem = hardware_problem(backend.capabilities, device)
        if problem:
            raise ValueError(f"backend {name!r} is not available: {problem}")
    problem = head_dims_problem(backend.capabilities, dims) or head_counts_problem(backend.capabilities, heads, layout)
    if problem:
        raise ValueError(f"backend {name!r} cannot run this model: {problem}; use backend='auto' or 'triton'")
    return backend


def device_sm(device: torch.device | str | None) -> int | None:
    """Compute capability (major * 10 + minor) of a CUDA ``device``; None for the CPU, or when
    ``device`` is None and there is no CUDA device. None picks CUDA device 0 when there is one."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = "cuda"
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def hardware_problem(caps: Capabilities, device: torch.device | str | None = None) -> str:
    """Why a backend with table ``caps`` cannot run on ``device`` ("" if it can)."""
    if caps.sm is None:
        return ""
    need = " or ".join(f"sm_{s}" for s in sorted(caps.sm))
    if device is not None and torch.device(device).type != "cuda":
        return f"its kernels need an NVIDIA GPU of compute capability {need}, got device {device}"
    if device is None and not torch.cuda.is_available():
        return f"its kernels need an NVIDIA GPU of compute capability {need}; this machine has no CUDA device"
    sm = device_sm(device)
    if sm not in caps.sm:
        return f"its kernels need an NVIDIA GPU of compute capability {need}, got sm_{sm}"
    return ""


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
