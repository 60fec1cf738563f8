"""Rewrite passes: ``fuse_rope_concat_cache`` and ``eliminate_concat``.

Both run on the post-grad graph (functional form: mutations are ``auto_functionalized(_v2)``
nodes) and return ``{layer: matches}`` so the pass manager can report and check them. What
they do is decided by the backend's capability table only.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops.backends import Backend
from .graph_utils import (
    _AF_V1,
    _AF_V2,
    forward_through_views,
    is_any_op,
    is_auto_functionalized,
    is_op,
    layer_of,
    mutated_base,
    names_of,
    op_arg,
    output_index,
    output_user,
    stable_topological_sort,
)

SPLIT_Q_CONSUMERS = ("mla_decode", "sparse_mla")  # generic ops that read q_nope and q_pe apart


def _cat_dim_is_last(cat: fx.Node) -> bool:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    val = cat.meta.get("val")
    return dim == -1 or (val is not None and dim == val.dim() - 1)


def _count(counts: dict, layer) -> None:
    counts[layer] = counts.get(layer, 0) + 1


def fuse_rope_concat_cache(graph: fx.Graph, backend: Backend) -> dict[int | None, int]:
    """rope -> cat(q_nope, q_rot) -> latent_cache_write  ==>  the backend's fused op.

    Matches, per layer, the backend's ``rope`` whose K output is written by its ``latent_cache_write``
    and whose Q output is concatenated after a ``q_nope``. The fused op takes the unrotated
    inputs, rotates (it applies RoPE itself, as its capability table says), writes the cache
    and returns q; the rotated K output is wired to the old K users when the backend's fused
    op returns K. When it returns none, a layer whose K has other users is left unfused
    (:func:`needs_missing_k`), and ``lint_backend_ops`` rejects any graph that reads that K.
    """
    caps = backend.capabilities
    counts: dict[int | None, int] = {}
    if not caps.fused_rope_cache:
        return counts
    fused = backend.op("fused_rope_concat_cache_write").default
    ropes, writes = names_of(backend, "rope"), names_of(backend, "latent_cache_write")
    for write in list(graph.nodes):
        if not (is_auto_functionalized(write) and is_any_op(write, writes)):
            continue
        rope, k_out = output_index(write.kwargs["k_pe"])
        if not (is_any_op(rope, ropes) and k_out == 1):
            continue
        q_rot, k_rot = output_user(rope, 0), output_user(rope, 1)
        if needs_missing_k(write, backend):
            continue  # the fused op returns no K, and something besides the write reads it
        cats = [u for u in (q_rot.users if q_rot else ()) if is_op(u, "aten::cat")]
        if q_rot is None or len(cats) != 1 or len(q_rot.users) != 1:
            continue
        cat = cats[0]
        tensors = cat.args[0]
        if len(tensors) != 2 or tensors[1] is not q_rot or not _cat_dim_is_last(cat):
            continue
        q_nope = tensors[0]
        q_pe, k_pe, positions, cos_sin, interleaved = rope.args[:5]
        cache = mutated_base(write, "kv_cache")
        kwargs = dict(
            q_nope=q_nope, q_pe=q_pe, kv_c=write.kwargs["kv_c"], k_pe=k_pe, positions=positions,
            cos_sin_cache=cos_sin, slot_mapping=write.kwargs["slot_mapping"], scale=write.kwargs["scale"],
            layout=write.kwargs["layout"], interleaved=interleaved,
        )
        with graph.inserting_before(write):
            if write.target is _AF_V2:
                node = graph.call_function(
                    _AF_V2, (fused,), {**kwargs, "_kv_cache_base_index": 0, "_all_bases": [cache]}
                )
            else:
                node = graph.call_function(_AF_V1, (fused,), {**kwargs, "kv_cache": cache})
            _copy_meta(write, node)
            new_q = graph.call_function(operator.getitem, (node, 0))
            new_k = graph.call_function(operator.getitem, (node, 1))
            new_cache = graph.call_function(operator.getitem, (node, 2))
        for n, src in ((new_q, cat), (new_k, k_rot), (new_cache, write)):
            if src is not None:
                _copy_meta(src, n)
        # Inductor re-traces auto_functionalized nodes from their fake values: (q, k, new cache).
        if "val" in cat.meta and "val" in rope.meta and "val" in write.meta:
            node.meta["val"] = (cat.meta["val"], rope.meta["val"][1], write.meta["val"][-1])
            new_q.meta["val"] = cat.meta["val"]
            new_k.meta["val"] = rope.meta["val"][1]
            new_cache.meta["val"] = write.meta["val"][-1]
        # the old write's only outputs are getitems of the cache's new value
        for user in list(write.users):
            user.replace_all_uses_with(new_cache)
            graph.erase_node(user)
        graph.erase_node(write)
        cat.replace_all_uses_with(new_q)
        graph.erase_node(cat)
        if caps.fused_returns_k and k_rot is not None:
            k_rot.replace_all_uses_with(new_k)
        _count(counts, layer_of(node))
    if counts:
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
    return counts


def needs_missing_k(write: fx.Node, backend: Backend) -> bool:
    """Would fusing this write lose a K that is read elsewhere?

    True when the backend's fused op returns no K (``fused_returns_k=False``, aiter's
    contract) and the rotated k_pe this write stores has another consumer (MHA prefill's
    keys). Such a layer keeps the unfused composition: fusing it would leave a second RoPE
    for that consumer (RoPE applied twice, lesson 2), and wiring the empty K to it is the
    null-K fault of lesson 1.
    """
    if backend.capabilities.fused_returns_k:
        return False
    rope, k_out = output_index(op_arg(write, "k_pe"))
    if not (is_any_op(rope, names_of(backend, "rope")) and k_out == 1):
        return False
    k_rot = output_user(rope, 1)
    return k_rot is not None and any(u is not write for u in forward_through_views(k_rot))


def eliminate_concat(graph: fx.Graph, backend: Backend) -> dict[int | None, int]:
    """Removes cat(q_latent, q_rot) when only a split-q attention op reads it back in halves.

    With ``decode_q_split`` the absorbed decode (and sparse MLA) read q_nope and q_pe as two
    tensors; concatenating q only to slice it again copies every query. Unfused: the slices
    read the cat's operands instead. Fused: the fused op gets a zero-width q_nope (so its q
    output is just the rotated q_pe) and the latent half reads the absorbed q directly.
    Backends whose decode wants q concatenated keep the cat; Inductor then realizes the absorb
    matmul straight into the concatenated buffer. The halves may be sliced from a view of q's
    leading dims (the decode's [B, s_q] split of the tokens); each half then gets the same view
    (:func:`_leading_view`).
    """
    counts: dict[int | None, int] = {}
    if not backend.capabilities.decode_q_split:
        return counts
    fused = backend.op("fused_rope_concat_cache_write").default
    for node in list(graph.nodes):
        fused_node = None
        if is_op(node, "aten::cat") and len(node.args[0]) == 2 and _cat_dim_is_last(node):
            q, (latent, rope_half) = node, node.args[0]
        elif is_auto_functionalized(node) and node.args[0] is fused:
            q = output_user(node, 0)
            if q is None:
                continue
            fused_node, latent, rope_half = node, node.kwargs["q_nope"], q
        else:
            continue
        width = _last_dim(latent)
        slices, views = _half_slices(q)
        if width is None or not slices:
            continue
        bounds = [_slice_bounds(u) for u in slices]
        if not all(b == (0, width) or (b[0] == width and b[1] >= (_last_dim(q) or 2**62)) for b in bounds):
            continue
        if not all(any(op_is_split_q_consumer(c, backend) for c in forward_through_views(u)) for u in slices):
            continue
        if fused_node is not None:
            with graph.inserting_before(fused_node):
                empty = graph.call_function(torch.ops.aten.slice.Tensor, (latent, -1, 0, 0))
            if "val" in latent.meta:
                empty.meta["val"] = latent.meta["val"][..., :0]
            fused_node.update_kwarg("q_nope", empty)
            # q is now just the rotated q_pe: shape and dtype of q_pe (Inductor re-traces the
            # fused node from these values, so they must be exact)
            q_pe_val = fused_node.kwargs["q_pe"].meta.get("val")
            vals = fused_node.meta.get("val")
            if q_pe_val is not None and vals is not None:
                q.meta["val"] = q_pe_val.new_empty(q_pe_val.shape)
                fused_node.meta["val"] = (q.meta["val"], *vals[1:])
        for u, view, (start, _) in zip(slices, views, bounds):
            for consumer in forward_through_views(u):
                if op_is_split_q_consumer(consumer, backend):
                    # Inductor lays a custom op's inputs out as they were when the graph was
                    # traced (its "eager_input_vals": here, slices of the cat, 576 wide), so
                    # it would copy both halves into a fresh cat-shaped buffer before the op
                    # and undo this pass. Without that record it passes the halves as they
                    # are; the split-q ops read their inputs through their strides.
                    consumer.meta.pop("eager_input_vals", None)
            half = latent if start == 0 else rope_half
            if view is not None:  # q was viewed [T, H, W] -> [B, s_q, H, W] before the slice
                with graph.inserting_before(u):
                    half = _leading_view(graph, half, view.args[1], u)
            u.replace_all_uses_with(half)
        _count(counts, layer_of(fused_node or q))
    graph.eliminate_dead_code()
    return counts


def _half_slices(q: fx.Node) -> tuple[list[fx.Node], list[fx.Node | None]]:
    """The last-dim slices that read q, each with the view of q's leading dims it slices (the
    decode's [B, s_q] split of the tokens) or None; ([], []) if q has any other reader."""
    slices, views = [], []
    for u in q.users:
        if _is_last_dim_slice(u):
            slices.append(u)
            views.append(None)
        elif _is_leading_view(u, q) and u.users and all(_is_last_dim_slice(s) for s in u.users):
            slices += list(u.users)
            views += [u] * len(u.users)
        else:
            return [], []
    return slices, views


def _is_leading_view(node: fx.Node, src: fx.Node) -> bool:
    """``aten.view`` / ``aten.reshape`` of src that keeps its last dim (only the leading dims regroup)."""
    if not ((is_op(node, "aten::view") or is_op(node, "aten::reshape")) and node.args[0] is src):
        return False
    sizes = node.args[1]
    return len(sizes) >= 1 and _last_dim(src) is not None and sizes[-1] == _last_dim(src)


def _leading_view(graph: fx.Graph, half: fx.Node, sizes: list, like: fx.Node) -> fx.Node:
    """half [T, H, W] viewed as q was: [*sizes[:-1], W] (sizes: q's view, [B, s_q, H, L + R]).

    The absorbed q half is a per-head bmm's [H, T, W] output transposed to [T, H, W]. A view of
    that strided tensor makes Inductor's lowering ask whether T == 1 (a guard: a one-token step
    would compile again), so T is split on the bmm's own contiguous output and the heads are
    moved after it. Any other half (a contiguous RoPE output) is viewed directly. ``like``: the
    slice this replaces (its fake value gives the symbolic sizes)."""
    shape = like.meta["val"].shape  # [B, s_q, H, W]
    lead = len(sizes) - 2  # the dims that split T
    if is_op(half, "aten::permute") and list(half.args[1]) == [1, 0, 2]:
        base = half.args[0]
        split = graph.call_function(torch.ops.aten.view.default, (base, [sizes[-2], *sizes[:-2], shape[-1]]))
        split.meta["val"] = base.meta["val"].view(shape[-2], *shape[:-2], shape[-1])
        order = [*range(1, lead + 1), 0, lead + 1]
        node = graph.call_function(torch.ops.aten.permute.default, (split, order))
        node.meta["val"] = split.meta["val"].permute(*order)
    else:
        node = graph.call_function(torch.ops.aten.view.default, (half, [*sizes[:-1], shape[-1]]))
        node.meta["val"] = half.meta["val"].view(*shape)
    _copy_meta(like, node)
    return node


def op_is_split_q_consumer(node: fx.Node, backend: Backend) -> bool:
    """The node is the backend's own decode or sparse MLA op (its name, not the generic one's:
    a triton-backend graph holds mlagraph_triton::mla_decode)."""
    return any(is_op(node, backend.op_names[g]) for g in SPLIT_Q_CONSUMERS)


def _is_last_dim_slice(node: fx.Node) -> bool:
    if not is_op(node, "aten::slice"):
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    val = node.meta.get("val")
    return dim == -1 or (val is not None and dim == val.dim() - 1)


def _slice_bounds(node: fx.Node) -> tuple[int, int]:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else 2**63 - 1
    return (start or 0), end


def _last_dim(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if val is None:
        return None
    size = val.shape[-1]
    return int(size) if isinstance(size, int) or not isinstance(size, torch.SymInt) else None


def _copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """Provenance only: the new node's own values differ (no eager_input_vals / val copying)."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
