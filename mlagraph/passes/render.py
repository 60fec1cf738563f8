"""The canonical graph printer used by golden tests; stable across torch 2.11-2.14.

Only what the passes act on is shown, so a golden changes when a pass changes and not when
PyTorch changes a decomposition:

- tensor inputs are ``in0, in1, ...`` in placeholder order (symbolic-size inputs are dropped);
- ``mlagraph`` ops, ``aten.cat`` and the collectives of a tensor-parallel rank
  (``_c10d_functional.all_reduce`` ...; the ``wait_tensor`` after each is folded into it) are
  printed one per line in topological order as ``v3 = mlagraph.rope(q_pe=..., ...)``,
  arguments by schema name;
- ``auto_functionalized(_v2)`` nodes are printed as the op they wrap, with the mutated tensor
  marked ``!`` (``kv_cache=in12!``);
- ``getitem`` is folded into ``v3.1``; view-like ops are folded into their source with a
  trailing ``~`` (``v3.1~``); any other computed value is ``_`` (its op is not part of the
  contract);
- a ``# layer N`` line opens each decoder layer (from dynamo's module stack).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import (
    af_bases, af_num_outputs, is_auto_functionalized, is_view, layer_of, mutated_base, op_of, op_name, schema_arg_names,
)

_SHOWN_ATEN = {"aten::cat"}
_WAIT = "_c10d_functional::wait_tensor"


def _shown(node: fx.Node) -> bool:
    name = op_name(node)
    if name is None or name == _WAIT:
        return False
    return name.startswith(("mlagraph", "_c10d_functional::")) or name in _SHOWN_ATEN


def render(graph_or_module: fx.Graph | fx.GraphModule) -> str:
    """Canonical text of an FX graph (see module docstring)."""
    graph = graph_or_module.graph if isinstance(graph_or_module, fx.GraphModule) else graph_or_module
    names: dict[fx.Node, str] = {}
    n_in = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val", node.meta.get("example_value"))
            if val is None or isinstance(val, torch.Tensor):
                names[node] = f"in{n_in}"
                n_in += 1

    def ref(x) -> str:
        if isinstance(x, _Marked):
            return ref(x.node) + "!"
        if isinstance(x, fx.Node):
            if x in names:
                return names[x]
            if op_name(x) == _WAIT:  # a collective's result, once waited for
                return ref(x.args[0])
            if x.op == "call_function" and x.target is operator.getitem:
                producer, i = x.args
                if is_auto_functionalized(producer):
                    n_out = af_num_outputs(producer)
                    if i >= n_out:  # the mutated tensor's new value: "in12'" = in12 after the write
                        return ref(af_bases(producer)[i - n_out]) + "'"
                if producer in names:
                    return f"{names[producer]}.{i}"
            if is_view(x) and isinstance(x.args[0], fx.Node):
                inner = ref(x.args[0])
                return inner if inner.endswith("~") or inner == "_" else inner + "~"
            return "_"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(ref(a) for a in x) + "]"
        if isinstance(x, torch.dtype):
            return str(x).replace("torch.", "")
        if isinstance(x, float):
            return f"{x:.6g}"
        return repr(x)

    lines = [f"inputs: {n_in} tensors"]
    current_layer = object()
    count = 0
    for node in graph.nodes:
        if node.op != "call_function" or not _shown(node):
            continue
        layer = layer_of(node)
        if layer != current_layer and layer is not None:
            lines.append(f"# layer {layer}")
            current_layer = layer
        op = op_of(node)
        label = op_name(node).replace("::", ".")
        if label == "aten.cat":
            args = [ref(node.args[0])] + [ref(a) for a in node.args[1:]]
        else:
            arg_names = schema_arg_names(op)
            if is_auto_functionalized(node):
                values = _af_arguments(node, op)
            else:
                values = dict(zip(arg_names, node.args))
                values.update(node.kwargs)
            # An argument left at its schema default is not shown (newer optional arguments do
            # not change older goldens).
            defaulted = {a.name for a in op._schema.arguments if a.has_default_value()}
            args = [f"{k}={ref(values.get(k))}" for k in arg_names if k in values or k not in defaulted]
        has_out = bool(node.users) and not (is_auto_functionalized(node) and not _af_op_outputs_used(node, op))
        if has_out:
            names[node] = f"v{count}"
            count += 1
            lines.append(f"{names[node]} = {label}({', '.join(args)})")
        else:
            lines.append(f"{label}({', '.join(args)})")
    return "\n".join(lines)


def _af_arguments(node: fx.Node, op) -> dict:
    """An auto_functionalized node's op arguments, mutated ones rendered as ``base!``."""
    values = dict(node.kwargs)
    for arg in op._schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write:
            values[arg.name] = _Marked(mutated_base(node, arg.name))
    return values


class _Marked:
    def __init__(self, node):
        self.node = node


def _af_op_outputs_used(node: fx.Node, op) -> bool:
    return any(u.target is operator.getitem and u.args[1] < af_num_outputs(node) for u in node.users)
