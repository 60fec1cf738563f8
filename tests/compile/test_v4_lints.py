"""The graph lints on DeepSeek-V4 graphs: a correct step passes; a lost window write, a lost
compressor update or an unrotated window row is rejected, naming the layer and the op."""

from __future__ import annotations

import operator

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import build_batch
from mlagraph.passes import LintError, fusion_v4, lints
from mlagraph.passes.graph_utils import layer_of, op_name
from mlagraph.passes.graph_utils import op_arg
from tests.compile.test_passes import capture
from tests.model.test_oracle_v4 import v4_config

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _step(decode: bool):
    cfg = v4_config(num_hidden_layers=3, layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe"]).to_dict()
    model = DeepseekForCausalLM.from_config(cfg, init_std=0.2)
    caps = model.backend.capabilities
    if decode:
        batch = build_batch(caps, [[4], [5]], [6, 3], [[0, 1], [2]], 4, is_decode=[True, True])
    else:
        batch = build_batch(caps, [[1, 2, 3, 4, 5], [6, 7]], [0, 0], [[0, 1], [2]], 4)
    return model, batch, model.allocate_caches(8, 4)


def _aot_graph(decode: bool = False):
    """The functional graph the pass manager lints (what a compile checks)."""
    model, batch, caches = _step(decode)
    return capture(model, batch, caches), model.backend


def _graph():
    """The dynamo graph (plain in-place calls, so a write can simply be erased)."""
    model, batch, caches = _step(False)
    captured = {}

    def grab(gm, example_inputs):
        captured["graph"] = gm.graph
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab, fullgraph=True)(batch, caches)
    return captured["graph"], model.backend


def _node(graph, op: str, layer: int):
    (node,) = [n for n in graph.nodes if op_name(n) == op and layer_of(n) == layer]
    return node


@pytest.mark.parametrize("decode", [False, True])
def test_lints_pass_on_v4_graphs_and_catch_an_unrotated_window_row(decode):
    graph, backend = _aot_graph(decode)
    for lint in lints.LINTS.values():
        lint(graph, backend)
    write = _node(graph, "mlagraph::swa_cache_write", 0)
    rope = next(n for n in graph.nodes if op_name(n) == "mlagraph::rope" and layer_of(n) == 0)
    write.kwargs = {**write.kwargs, "kv": op_arg(rope, "k_pe")}  # the row before its rotation
    with pytest.raises(LintError, match=r"RoPE skipped in layer 0 \(mlagraph::swa_cache_write.*kv is not rotated"):
        lints.lint_rope_once(graph, backend)


def test_lost_window_write_is_rejected():
    graph, backend = _graph()
    graph.erase_node(_node(graph, "mlagraph::swa_cache_write", 1))
    with pytest.raises(LintError, match=r"layer 1 \(mlagraph::csa_attention.*\(kv_cache\), which this step never"):
        lints.lint_write_once(graph, backend)


def test_lost_compressor_update_is_rejected():
    graph, backend = _graph()
    graph.erase_node(_node(graph, "mlagraph::compressor_update", 2))
    with pytest.raises(LintError, match=r"layer 2 \(mlagraph::hca_attention.*\(compressed_cache\)"):
        lints.lint_write_once(graph, backend)


# --- on fused graphs (fuse_v4_rope_window_write) ------------------------------------------------


def _fused(decode: bool):
    graph, backend = _aot_graph(decode)
    assert fusion_v4.fuse_v4_rope_window_write(graph, backend) == {0: 1, 1: 1, 2: 1}
    return graph, backend


@pytest.mark.parametrize("decode", [False, True])
def test_lints_pass_on_fused_v4_graphs(decode):
    graph, backend = _fused(decode)
    assert not [n for n in graph.nodes if op_name(n) == "mlagraph::swa_cache_write"]
    for lint in lints.LINTS.values():
        lint(graph, backend)


def test_fused_graph_with_an_unrotated_query_is_rejected():
    graph, backend = _fused(False)
    fused = _node(graph, "mlagraph::fused_rope_concat_cache_write", 2)
    attention = _node(graph, "mlagraph::hca_attention", 2)
    attention.update_kwarg("q", fused.kwargs["q_nope"])  # the head, never rotated
    with pytest.raises(LintError, match=r"RoPE skipped in layer 2 \(mlagraph::hca_attention.*q is not rotated"):
        lints.lint_rope_once(graph, backend)


def test_a_second_reader_of_the_rotated_row_keeps_the_layer_unfused_and_a_second_write_is_caught():
    """Two writes of the same row (say a refactor left the old one in): the pass leaves that
    layer alone (its rotated row has another reader), fuses the others, and the lint names the
    cache written twice."""
    graph, backend = _aot_graph(False)
    write = _node(graph, "mlagraph::swa_cache_write", 1)
    (new_cache,) = write.users  # getitem: the cache's value after the write
    with graph.inserting_after(new_cache):  # a second write of that value, read from then on
        again = graph.node_copy(write)
        again.update_kwarg("_all_bases", [new_cache])
        newer = graph.call_function(operator.getitem, (again, 1))
    new_cache.replace_all_uses_with(newer, delete_user_cb=lambda user: user is not again)
    assert fusion_v4.fuse_v4_rope_window_write(graph, backend) == {0: 1, 2: 1}
    with pytest.raises(LintError, match=r"lint_write_once: cache .* written 2 times: layer 1 \(mlagraph::swa_cache"):
        lints.lint_write_once(graph, backend)
