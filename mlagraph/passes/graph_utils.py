"""Small helpers the passes share: which node is which op, views, layers, mutated caches.

The passes work on post-grad (or AOT) FX graphs in functional form, where a mutating custom op
appears as ``auto_functionalized(_v2)(op, **kwargs)`` followed by getitems of its outputs.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

_AF_V1 = getattr(torch.ops.higher_order, "auto_functionalized", None)
_AF_V2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)

# Ops that only re-index or re-type a tensor's data (views, copies, row gathers): values flow
# through them unchanged.
_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "select", "slice", "expand", "permute",
    "transpose", "t", "alias", "clone", "contiguous", "as_strided", "_to_copy", "squeeze_copy",
    "view_copy", "unsqueeze_copy", "expand_copy", "select_copy", "slice_copy", "split", "split_with_sizes",
    "unbind", "narrow", "index_select", "index",
}

_LAYER_RE = re.compile(r"layers[.\[](\d+)")


def is_auto_functionalized(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_AF_V1, _AF_V2) and node.target is not None


def op_of(node: fx.Node):
    """The op a call node runs (the wrapped op for auto_functionalized nodes), else None."""
    if node.op != "call_function":
        return None
    if is_auto_functionalized(node):
        return node.args[0]
    return node.target


def op_name(node: fx.Node) -> str | None:
    """'namespace::name' of a node's op (OpOverload or packet), or None for non-op nodes."""
    op = op_of(node)
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return None


def is_op(node: fx.Node, qualified: str) -> bool:
    return op_name(node) == qualified


def names_of(backend, *generics: str) -> frozenset[str]:
    """Qualified names these generic ops can have in a graph of ``backend``: the backend's own
    (a triton graph holds mlagraph_triton::rope, an aiter graph mlagraph_aiter::mla_decode) and
    the generic reference ones (code that calls torch.ops.mlagraph.* directly)."""
    return frozenset({f"mlagraph::{g}" for g in generics} | {backend.op_names[g] for g in generics})


def is_any_op(node: fx.Node, qualified: frozenset[str]) -> bool:
    return op_name(node) in qualified


def is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return not _is_multi_output_op(node.args[0])
    name = op_name(node)
    return name is not None and name.startswith("aten::") and name.split("::")[1] in _VIEW_OPS


def _is_multi_output_op(node) -> bool:
    """getitem on an op with several outputs selects an output; on a split it is a view."""
    if not isinstance(node, fx.Node):
        return False
    name = op_name(node)
    return not (name and name.startswith("aten::") and name.split("::")[1] in _VIEW_OPS)


def view_root(node: fx.Node) -> fx.Node:
    """Follows view-like ops back to the node that produced the data."""
    while isinstance(node, fx.Node) and is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def output_index(node: fx.Node) -> tuple[fx.Node, int | None]:
    """For ``getitem(producer, i)``: (producer, i); else (node, None). Views are looked through."""
    node = view_root(node)
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0], node.args[1]
    return node, None


def forward_through_views(node: fx.Node) -> list[fx.Node]:
    """Users of ``node``, looking through view-like ops and getitems (and into cat operands)."""
    out, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user) or (user.op == "call_function" and user.target is operator.getitem):
            stack.extend(user.users)
        else:
            out.append(user)
    return out


def op_arg(node: fx.Node, name: str):
    """An op argument by schema name, whether the node is ``auto_functionalized`` (all kwargs)
    or a plain call (positional or keyword)."""
    if is_auto_functionalized(node) or name in node.kwargs:
        return node.kwargs.get(name)
    index = schema_arg_names(op_of(node)).index(name)
    return node.args[index] if index < len(node.args) else None


def output_user(node: fx.Node, index: int) -> fx.Node | None:
    """The ``getitem(node, index)`` reading one output of a multi-output node, if any."""
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def mutated_base(node: fx.Node, arg: str) -> fx.Node | None:
    """The tensor a node mutates for argument ``arg``: the base of an auto_functionalized(_v2)
    node, or the argument itself of a plain (in-place) call."""
    if node.target is _AF_V2:
        base_index = node.kwargs.get(f"_{arg}_base_index")
        if base_index is None:
            return None
        return node.kwargs["_all_bases"][base_index]
    return op_arg(node, arg)


def af_num_outputs(node: fx.Node) -> int:
    """How many of an auto_functionalized node's outputs are the op's own (the mutated tensors'
    new values follow). An op returning nothing still has one (None) slot."""
    return max(1, len(node.args[0]._schema.returns))


def af_bases(node: fx.Node) -> list:
    """The tensors an auto_functionalized node mutates, in the order of its extra outputs."""
    if node.target is _AF_V2:
        return list(node.kwargs["_all_bases"])
    op = node.args[0]
    return [node.kwargs[a.name] for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def tensor_root(node):
    """The tensor a (functionally) mutated value started as, usually a graph input.

    In functional form, a second write to a cache mutates the first write's output (the
    cache's new value, ``getitem(auto_functionalized(...), i)`` past the op's own outputs), not
    the graph input. This follows those new values, and views, back to the original tensor, so
    two writes to one cache are seen as writes to the same tensor.
    """
    for _ in range(10_000):
        if not isinstance(node, fx.Node):
            return node
        node = view_root(node)
        if not (node.op == "call_function" and node.target is operator.getitem):
            return node
        producer, i = node.args
        if not (isinstance(producer, fx.Node) and is_auto_functionalized(producer)):
            return node
        n_out = af_num_outputs(producer)
        if i < n_out:
            return node
        node = af_bases(producer)[i - n_out]
    raise RuntimeError("tensor_root: cycle")


def layer_of(node: fx.Node) -> int | None:
    """The decoder layer a node came from (dynamo's nn_module_stack), or None if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = _LAYER_RE.search(str(path))
        if m:
            return int(m.group(1))
    return None


def schema_arg_names(op) -> list[str]:
    """Argument names of an op (an OpOverload, or a packet: its default overload)."""
    schema = op._schema if isinstance(op, torch._ops.OpOverload) else op.default._schema
    return [a.name for a in schema.arguments]


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorders nodes so every input comes before its user, moving as little as possible.

    A rewrite inserts its new node next to one of the nodes it replaces; when that spot comes
    before another of its inputs, this restores a valid order (keeping the original order
    wherever it already was valid).
    """
    order = list(graph.nodes)
    placed: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}
    result: list[fx.Node] = []

    def visit(n: fx.Node) -> None:
        if n in placed:
            return
        missing = next((i for i in n.all_input_nodes if i not in placed), None)
        if missing is not None:
            waiting.setdefault(missing, []).append(n)
            return
        result.append(n)
        placed.add(n)
        for w in waiting.pop(n, []):
            visit(w)

    for n in order:
        visit(n)
    if len(result) != len(order):
        raise RuntimeError("stable_topological_sort: the graph has a cycle")
    for before, after in zip(result, result[1:]):
        before.append(after)
