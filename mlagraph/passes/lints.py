"""Graph lints: prove, per layer, what the field got wrong (docs/design.md, rules 1, 2 and 6).

- ``lint_rope_once``: the main MLA q_pe and k_pe are rotated exactly once per layer (not
  skipped, not twice: a rotation never feeds another rotation); DeepSeek-V4's too: the K=V row
  its window cache gets and the queries of its attention are rotated.
- ``lint_write_once``: each layer writes its new tokens' latents to its cache exactly once,
  and every cache an attention reads was written this step (V4: the window cache, and the
  compressed entries its compressors write).
- ``lint_backend_ops``: no op private to another backend appears in this backend's graph, and
  no fused op's missing output (a K it does not return) is consumed.

Each raises :class:`LintError` naming the layer and the op.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ..ops import backends as backend_registry
from ..ops.backends import Backend
from .graph_utils import (
    forward_through_views, is_auto_functionalized, layer_of, mutated_base, names_of, op_arg, op_name, output_user,
    tensor_root, view_root,
)

ATTENTION = ("mla_decode", "mha_prefill", "sparse_mla")
_LATENT_ATTENTION = ("mla_decode", "sparse_mla")  # read q_pe and the latent cache
# ops that read the latent cache (argument kv_cache)
_CACHE_READERS = ("mla_decode", "sparse_mla", "latent_cache_read")
# DeepSeek-V4: generic op -> the cache arguments it writes / reads
_V4_WRITES = {"swa_cache_write": ("kv_cache",), "compressor_update": ("state_cache", "compressed_cache")}
_V4_WINDOW = ("kv_cache",)
_V4_COMPRESSED = ("kv_cache", "compressed_cache")
_V4_READS = {
    "swa_attention": _V4_WINDOW, "swa_decode": _V4_WINDOW, "hca_attention": _V4_COMPRESSED,
    "hca_decode": _V4_COMPRESSED, "csa_attention": _V4_COMPRESSED, "csa_decode": _V4_COMPRESSED,
    "csa_indexer_topk": ("index_cache",),
}
_V4_ATTENTION = tuple(g for g in _V4_READS if g != "csa_indexer_topk")  # their queries are rotated


class LintError(RuntimeError):
    """A compiled graph breaks an mlagraph invariant."""


def _where(node: fx.Node) -> str:
    layer = layer_of(node)
    return f"layer {layer if layer is not None else '?'} ({op_name(node) or node.target}, node {node.name})"


def _rotations(backend: Backend) -> set[str]:
    """Ops that apply RoPE: the rope op, and the backend's fused op when it rotates."""
    names = set(names_of(backend, "rope"))
    if backend.capabilities.fused_applies_rope:
        names.add(backend.op_names["fused_rope_concat_cache_write"])
    return names


def _cache_writers(backend: Backend) -> set[str]:
    names = set(names_of(backend, "latent_cache_write"))
    if backend.capabilities.fused_writes_cache:
        names.add(backend.op_names["fused_rope_concat_cache_write"])
    return names


def _by_op(backend: Backend, table: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """{generic op: args} -> {qualified name (generic and the backend's): args}."""
    return {name: args for g, args in table.items() for name in names_of(backend, g)}


def _derives_from_rotation(node, rotations: set[str], depth: int = 0) -> bool:
    """Does this value come (through views, getitems and cat operands) from a rotation?"""
    if not isinstance(node, fx.Node) or depth > 64:
        return False
    node = view_root(node)
    if node.op == "call_function" and node.target is operator.getitem:
        return _derives_from_rotation(node.args[0], rotations, depth + 1)
    name = op_name(node)
    if name in rotations:
        return True
    if name == "aten::cat":
        return any(_derives_from_rotation(a, rotations, depth + 1) for a in node.args[0])
    return False


def _reaches_latent_attention(node: fx.Node, writers: set[str], attention: set[str]) -> bool:
    """Does this rotation's output reach the latent cache or an MLA attention op?

    Looks through views, getitems and concatenations: MHA prefill reads k_pe through
    cat(k_nope, k_rot), so a second rotation feeding only that K is still counted.
    """
    stack, seen = [node], set()
    while stack:
        for user in forward_through_views(stack.pop()):
            if user in seen:
                continue
            seen.add(user)
            name = op_name(user)
            if name in writers or name in attention:
                return True
            if name == "aten::cat":
                stack.append(user)
    return False


def lint_rope_once(graph: fx.Graph, backend: Backend) -> None:
    rotations = _rotations(backend)
    v4_write, v4_attention = names_of(backend, "swa_cache_write"), names_of(backend, *_V4_ATTENTION)
    writers = _cache_writers(backend) | v4_write
    attention, latent_attention = names_of(backend, *ATTENTION) | v4_attention, names_of(backend, *_LATENT_ATTENTION)
    per_layer: dict[int | None, list[fx.Node]] = {}
    for node in graph.nodes:
        if op_name(node) not in rotations:
            continue
        # Rotating something already rotated is RoPE applied twice.
        rope_inputs = (op_arg(node, "q_pe"), op_arg(node, "k_pe"))
        rotated_inputs = [a for a in rope_inputs if _derives_from_rotation(a, rotations)]
        if rotated_inputs:
            raise LintError(f"lint_rope_once: RoPE applied twice in {_where(node)}: its input is already rotated")
        if is_auto_functionalized(node) or _reaches_latent_attention(node, writers, attention):
            per_layer.setdefault(layer_of(node), []).append(node)
    plain_writes = names_of(backend, "latent_cache_write")
    for writer in graph.nodes:
        if op_name(writer) not in plain_writes:
            continue
        if not _derives_from_rotation(op_arg(writer, "k_pe"), rotations):
            raise LintError(f"lint_rope_once: RoPE skipped in {_where(writer)}: the cached k_pe is not rotated")
    for layer, nodes in per_layer.items():
        if len(nodes) > 1:
            where = ", ".join(_where(n) for n in nodes)
            raise LintError(f"lint_rope_once: layer {layer}: q_pe/k_pe rotated {len(nodes)} times: {where}")
    for attn in graph.nodes:
        if op_name(attn) in latent_attention:
            if not _derives_from_rotation(op_arg(attn, "q_pe"), rotations):
                raise LintError(f"lint_rope_once: RoPE skipped in {_where(attn)}: q_pe is not rotated")
    for node in graph.nodes:  # DeepSeek-V4: the window row and the queries carry RoPE on their tail
        name = op_name(node)
        arg = "kv" if name in v4_write else "q" if name in v4_attention else None
        if arg and not _derives_from_rotation(op_arg(node, arg), rotations):
            raise LintError(f"lint_rope_once: RoPE skipped in {_where(node)}: {arg} is not rotated")


def lint_write_once(graph: fx.Graph, backend: Backend) -> None:
    writes = {w: ("kv_cache",) for w in _cache_writers(backend)} | _by_op(backend, _V4_WRITES)
    reads = {r: ("kv_cache",) for r in names_of(backend, *_CACHE_READERS)} | _by_op(backend, _V4_READS)
    per_cache: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        for arg in writes.get(op_name(node), ()):
            base = mutated_base(node, arg)
            # a second functional write mutates the first one's output: same cache
            per_cache.setdefault(tensor_root(base), []).append(node)
    for cache, nodes in per_cache.items():
        if len(nodes) != 1:
            where = ", ".join(_where(n) for n in nodes)
            raise LintError(
                f"lint_write_once: cache {getattr(cache, 'name', cache)} written {len(nodes)} times: {where}"
            )
    # A cache that attention reads must have been written this step (the new tokens' latents):
    # zero writes means the step attends to stale rows.
    for node in graph.nodes:
        for arg in reads.get(op_name(node), ()):
            cache = tensor_root(op_arg(node, arg))
            if cache not in per_cache:
                raise LintError(
                    f"lint_write_once: {_where(node)} reads cache {getattr(cache, 'name', cache)} ({arg}), "
                    f"which this step never writes"
                )


def lint_backend_ops(graph: fx.Graph, backend: Backend) -> None:
    own = set(backend.op_names.values())
    foreign: dict[str, str] = {}
    for other in backend_registry.registered():
        for q in other.owned_ops() - own:
            foreign[q] = other.name
    fused_name = backend.op_names["fused_rope_concat_cache_write"]
    for node in graph.nodes:
        name = op_name(node)
        if name in foreign:
            raise LintError(
                f"lint_backend_ops: {_where(node)} is private to backend {foreign[name]!r}, "
                f"not {backend.name!r}"
            )
        if name == fused_name and not backend.capabilities.fused_returns_k:
            k_out = output_user(node, 1)
            if k_out is not None and k_out.users:
                consumers = ", ".join(u.name for u in k_out.users)
                raise LintError(
                    f"lint_backend_ops: {_where(node)} returns no K on backend {backend.name!r}, "
                    f"but its K output is consumed by {consumers}"
                )


# lint_backend_ops first: with another backend's op in the graph, the other lints' reading of
# which op rotates and which writes is wrong, and the foreign op is the error to report.
LINTS = {"lint_backend_ops": lint_backend_ops, "lint_rope_once": lint_rope_once, "lint_write_once": lint_write_once}
