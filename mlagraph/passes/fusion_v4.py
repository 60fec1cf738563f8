"""``fuse_v4_rope_window_write``: DeepSeek-V4's front (RoPE on the tails, window cache write) as
the backend's fused RoPE -> concat -> cache-write op.

A V4 layer rotates the last R dims of its queries q [T, H, D] and of its one K=V row kv
[T, 1, D] with one ``rope`` call, concatenates each back onto its unrotated head, and writes the
rotated row into the window cache (``swa_cache_write``). That is exactly
``fused_rope_concat_cache_write`` with layout ``bf16`` (a row of ``D - R`` plain values, then the
R rotated ones, in the cache's dtype: the window cache's row), so no new op is needed:

    rope(q_tail, kv_tail) -> cat(q_head, q_rot), cat(kv_head, kv_rot)[:, 0] -> swa_cache_write
      ==>  q, _ = fused_rope_concat_cache_write(q_head, q_tail, kv_head[:, 0], kv_tail, ...)

The rotated row's only reader must be the write (it is in the model: attention reads the cache),
or the layer is left as it is. Runs only where the capability table says the backend's fused op
serves V4's window cache (``fused_rope_window_write``); the lints then see the fused op as
the rotation and the window write, as they do for MLA.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops.backends import Backend
from .fusion import _cat_dim_is_last, _copy_meta, _count
from .graph_utils import (
    _AF_V1, _AF_V2, forward_through_views, is_any_op, is_auto_functionalized, is_op, layer_of, mutated_base,
    names_of, output_index, output_user, stable_topological_sort, view_root,
)


def _tail_cat(rope_out: fx.Node | None) -> fx.Node | None:
    """The one cat(head, rope_out) on the last dim that is rope_out's only user, else None."""
    if rope_out is None or len(rope_out.users) != 1:
        return None
    (cat,) = rope_out.users
    if not is_op(cat, "aten::cat") or len(cat.args[0]) != 2 or cat.args[0][1] is not rope_out:
        return None
    return cat if _cat_dim_is_last(cat) else None


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def fuse_v4_rope_window_write(graph: fx.Graph, backend: Backend) -> dict[int | None, int]:
    counts: dict[int | None, int] = {}
    if not backend.capabilities.fused_rope_window_write:
        return counts
    fused = backend.op("fused_rope_concat_cache_write").default
    ropes, writes = names_of(backend, "rope"), names_of(backend, "swa_cache_write")
    for write in list(graph.nodes):
        if not (is_auto_functionalized(write) and is_any_op(write, writes)):
            continue
        kv_cat = view_root(write.kwargs["kv"])
        rope, k_out = output_index(kv_cat.args[0][1]) if is_op(kv_cat, "aten::cat") else (None, None)
        if not (is_any_op(rope, ropes) and k_out == 1):
            continue
        q_cat, k_cat = _tail_cat(output_user(rope, 0)), _tail_cat(output_user(rope, 1))
        # the rotated row goes to the cache and nowhere else: fusing drops it
        if q_cat is None or k_cat is not kv_cat or forward_through_views(kv_cat) != [write]:
            continue
        kv_head = kv_cat.args[0][0]
        if _val(kv_head) is None or _val(kv_head).dim() != 3 or _val(kv_head).shape[1] != 1:
            continue
        q_pe, k_pe, positions, cos_sin, interleaved = rope.args[:5]
        cache = mutated_base(write, "kv_cache")
        with graph.inserting_before(write):
            kv_c = graph.call_function(torch.ops.aten.select.int, (kv_head, 1, 0))  # [T, D - R]
            kv_c.meta["val"] = _val(kv_head)[:, 0]
            kwargs = dict(q_nope=q_cat.args[0][0], q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, positions=positions,
                          cos_sin_cache=cos_sin, slot_mapping=write.kwargs["slot_mapping"], scale=None,
                          layout="bf16", interleaved=interleaved)
            if write.target is _AF_V2:
                node = graph.call_function(_AF_V2, (fused,), {**kwargs, "_kv_cache_base_index": 0,
                                                              "_all_bases": [cache]})
            else:
                node = graph.call_function(_AF_V1, (fused,), {**kwargs, "kv_cache": cache})
            _copy_meta(write, node)
            new_q = graph.call_function(operator.getitem, (node, 0))
            new_cache = graph.call_function(operator.getitem, (node, 2))
        _copy_meta(q_cat, new_q)
        # Inductor re-traces auto_functionalized nodes from their fake values: (q, k, new cache).
        if "val" in q_cat.meta and "val" in rope.meta and "val" in write.meta:
            node.meta["val"] = (q_cat.meta["val"], rope.meta["val"][1], write.meta["val"][-1])
            new_q.meta["val"] = q_cat.meta["val"]
            new_cache.meta["val"] = write.meta["val"][-1]
        for user in list(write.users):  # getitems of the cache's new value
            user.replace_all_uses_with(new_cache)
            graph.erase_node(user)
        graph.erase_node(write)
        q_cat.replace_all_uses_with(new_q)
        graph.erase_node(q_cat)
        _count(counts, layer_of(node))
    if counts:
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
    return counts
