"""``backend="auto"``: the fastest composition of the registered backends for one device.

:func:`compose` is a pure function of the capability tables, which backends are installed,
the device's compute capability and the latent cache layout: for each generic op it walks
:data:`PREFERENCE` (fastest first, from the H200 measurements in docs/design.md) and takes the
first backend that is installed, runs on the device, has its OWN kernel for the op (not a
declared fallback) and reads the cache layout when the op reads the cache. Every other op runs
the base backend's op: triton on a GPU, reference on the CPU. No environment variable or flag
takes part (docs/design.md rule 1).

:func:`resolve` asks the machine those facts once and returns the composed
:class:`~mlagraph.ops.backends.Backend`. When every op lands on one backend that backend itself
is returned (``reference`` on the CPU, ``triton`` on a GPU without the libraries). Otherwise
the composition is a Backend of its own, named after its parts, for example
``auto[mla_decode=flashmla,mha_prefill=flashinfer,sparse_mla=flashmla,*=triton]``; its
capability table is derived from the parts' tables (:func:`composed_capabilities`).

    >>> compose(None, {"triton": True}, "bf16")["mla_decode"]
    'reference'
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import backends as _b

# generic op -> backends to try, fastest first (measured on the H200, docs/design.md). aiter is
# not listed: its Triton decode is slower than ours on NVIDIA GPUs.
PREFERENCE: Mapping[str, tuple[str, ...]] = {
    "mla_decode": ("flashmla", "flashinfer"),
    "mha_prefill": ("flashinfer",),
    "sparse_mla": ("flashmla",),
}

# Ops that read or write the latent cache: their backend must take the model's layout.
CACHE_OPS = frozenset({"latent_cache_write", "latent_cache_read", "fused_rope_concat_cache_write", "mla_decode",
                       "sparse_mla"})


def _fits(caps: _b.Capabilities, op: str, sm: int | None, layout: str,
          dims: Mapping[str, tuple[int, int]], heads: Mapping[str, int]) -> bool:
    if caps.sm is not None and sm not in caps.sm:
        return False
    if op in caps.fallbacks:  # it would run another backend's op: not a reason to pick it
        return False
    if op in dims and op in caps.head_dims and tuple(dims[op]) not in caps.head_dims[op]:
        return False  # its kernel is not built for the model's head widths
    counts = _b.head_counts_for(caps, op, layout)
    if op in heads and counts is not None and heads[op] not in counts:
        return False  # nor for this many query heads (a tensor-parallel shard, say)
    return op not in CACHE_OPS or layout in caps.latent_layouts


def compose(sm: int | None, installed: Mapping[str, bool], layout: str,
            tables: Mapping[str, _b.Capabilities] | None = None,
            dims: Mapping[str, tuple[int, int]] | None = None,
            heads: Mapping[str, int] | None = None) -> dict[str, str]:
    """generic op -> the backend whose op ``auto`` runs for it.

    Args:
        sm: the device's compute capability (major * 10 + minor), None for the CPU.
        installed: backend name -> whether it can be loaded (missing names: not installed).
        layout: the latent cache layout ("bf16", "fp8", "fp8_ds").
        tables: backend name -> capability table (default: the registry's).
        dims: the model's head widths per op (:attr:`~mlagraph.ops.backends.Capabilities.head_dims`);
            a kernel not built for them is not picked. None: any widths.
        heads: the model's query heads per op, per rank (:attr:`~mlagraph.ops.backends.Capabilities.head_counts`);
            a kernel that takes other head counts is not picked. None: any count.
    """
    dims, heads = dims or {}, heads or {}
    tables = tables if tables is not None else {b.name: b.capabilities for b in _b.registered() if b.parts is None}
    if sm is None:
        return {g: "reference" for g in _b.GENERIC_OPS}
    base = "triton" if installed.get("triton") else "reference"
    parts = {}
    for g in _b.GENERIC_OPS:
        picks = [n for n in PREFERENCE.get(g, ()) if installed.get(n) and n in tables and _fits(tables[n], g, sm, layout, dims, heads)]
        parts[g] = picks[0] if picks else base
    return parts


def composed_name(parts: Mapping[str, str]) -> str:
    """``auto[op=backend,...,*=base]``: the ops that differ from the most common backend, then it."""
    counts: dict[str, int] = {}
    for b in parts.values():
        counts[b] = counts.get(b, 0) + 1
    base = max(counts, key=lambda b: (counts[b], b == "triton"))
    special = ",".join(f"{g}={b}" for g, b in parts.items() if b != base)
    return f"auto[{special},*={base}]"


def composed_capabilities(parts: Mapping[str, str], tables: Mapping[str, _b.Capabilities]) -> _b.Capabilities:
    """The table of a composition: each answer from the backend that runs the op it is about."""
    t = {g: tables[b] for g, b in parts.items()}
    dec, pre, sparse, fused = t["mla_decode"], t["mha_prefill"], t["sparse_mla"], t["fused_rope_concat_cache_write"]
    layouts = frozenset.intersection(*(t[g].latent_layouts for g in CACHE_OPS))
    sizes = [c.page_sizes for c in t.values() if c.page_sizes is not None]
    page_sizes = frozenset.intersection(*sizes) if sizes else None
    sms = [c.sm for c in t.values() if c.sm is not None]
    return _b.Capabilities(
        latent_layouts=layouts,
        indexer_layouts=t["indexer_topk"].indexer_layouts & t["indexer_cache_write"].indexer_layouts,
        fused_rope_cache=fused.fused_rope_cache,
        fused_applies_rope=fused.fused_applies_rope,
        fused_writes_cache=fused.fused_writes_cache,
        fused_returns_k=fused.fused_returns_k,
        decode_q_split=dec.decode_q_split,
        multi_token_decode=dec.multi_token_decode,
        mha_prefill=pre.mha_prefill,
        mha_over_prefix=pre.mha_over_prefix,
        sparse_mla=sparse.sparse_mla,
        cuda_graph_safe=frozenset(g for g in parts if g in t[g].cuda_graph_safe),
        dense_prefill_sdpa=pre.dense_prefill_sdpa,
        fallbacks=dict(parts),
        page_sizes=page_sizes,
        head_dims={g: t[g].head_dims[g] for g in parts if g in t[g].head_dims},
        head_counts={k: n for g in parts for k, n in t[g].head_counts.items() if k == g or k.startswith(f"{g}[")},
        preferred_page_size=min(page_sizes) if page_sizes else 16,
        sm=frozenset.intersection(*sms) if sms else None,
        step_metadata=any(c.step_metadata for c in t.values()),
    )


def build(parts: Mapping[str, str]) -> _b.Backend:
    """The Backend running each op of ``parts`` through the named registered backend's op."""
    reg = {b.name: b for b in _b.registered() if b.parts is None}
    caps = composed_capabilities(parts, {n: b.capabilities for n, b in reg.items()})
    return _b.Backend(name=composed_name(parts), capabilities=caps,
                      op_names={g: reg[b].op_names[g] for g, b in parts.items()}, parts=dict(parts))


def resolve(device: torch.device | str | None = None, layout: str = "bf16",
            dims: Mapping[str, tuple[int, int]] | None = None,
            heads: Mapping[str, int] | None = None) -> _b.Backend:
    """``auto`` for ``device`` (None: CUDA device 0 if any, else the CPU), ``layout``, the
    model's head widths ``dims`` and its query heads per rank ``heads``."""
    sm = _b.device_sm(device)
    installed = {}
    for b in _b.registered():
        if b.parts is None:
            installed[b.name] = b.available and not _b.hardware_problem(b.capabilities, device if sm else "cpu")
    parts = compose(sm, installed, layout, dims=dims, heads=heads)
    if len(set(parts.values())) == 1:
        return _b.get(next(iter(parts.values())), device)
    backend = build(parts)
    return _b._COMPOSED.setdefault(backend.name, backend)
