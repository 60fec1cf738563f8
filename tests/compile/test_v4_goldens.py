"""Golden graphs of DeepSeek-V4's layers (how to read them: tests/compile/test_goldens.py).

No pass rewrites V4's front yet (before == after; the RoPE + window-cache-write fusion and its
lints are still to come), so these pin what the model emits per layer type and plan: the
window write, the compressors (two in a CSA layer: its own and the indexer's), the indexer's
top-k, the attention op, the inverse rotation of the output (the second ``rope``: swapped pairs,
see mlagraph.model.attention_v4.unrotate_tail), and, for a dense plan, a CSA layer with no
indexer scoring at all (its keys still written by the second compressor_update).

After a deliberate change: ``EXPECTTEST_ACCEPT=1 python -m pytest tests/compile/test_v4_goldens.py``.
"""

from __future__ import annotations

import expecttest
import pytest
import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import build_batch
from tests.model.test_oracle_v4 import v4_config

pytestmark = pytest.mark.slow  # six compiles: about a minute on two CPU cores


def _model(layer_type: str) -> DeepseekForCausalLM:
    cfg = v4_config(num_hidden_layers=1, layer_types=[layer_type], mlp_layer_types=["moe"]).to_dict()
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2)


def _graph(model: DeepseekForCausalLM, kind: str) -> str:
    caps, ps, cfg = model.backend.capabilities, 4, model.config
    caches = model.allocate_caches(32, ps)
    kw = dict(dsa=cfg.uses_dsa, dsa_dense_max_kv_len=0)  # sparse unless the test asks for dense
    if kind == "dense_prefill":
        kw["dsa_dense_max_kv_len"] = cfg.dsa_dense_max_kv_len
    if kind == "decode":
        batch = build_batch(caps, [[1], [6]], [5, 2], [[0, 1], [2]], ps, is_decode=[True, True], **kw)
    else:
        batch = build_batch(caps, [[1, 2, 3, 4, 5], [6, 7]], [0, 0], [[0, 1], [2]], ps, **kw)
    assert batch.plan.dsa_dense == (kind == "dense_prefill")
    torch._dynamo.reset()
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True, strict=True)
    compiled(batch, caches)
    report = mlagraph.passes.last_compile()
    assert report.before == report.after  # no V4 pass yet
    return report.after


class TestV4Goldens(expecttest.TestCase):
    def test_sliding_prefill(self):
        self.assertExpectedInline(_graph(_model("sliding_attention"), "prefill"), """\
# embed
inputs: 2 tensors
# attention (sliding_attention): layer 0
inputs: 19 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
v3 = mlagraph.swa_attention(q=v1, kv_cache=in12', sinks=in14, positions=in11, req_ids=in15, block_table=in16, window=6, softmax_scale=0.25)
v4 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v5 = aten.cat([v3.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    def test_sliding_decode(self):
        self.assertExpectedInline(_graph(_model("sliding_attention"), "decode"), """\
# embed
inputs: 2 tensors
# attention (sliding_attention): layer 0
inputs: 19 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
v3 = mlagraph.swa_decode(q=v1~, kv_cache=in12', sinks=in15, block_table=in14, seq_lens=in16, window=6, softmax_scale=0.25)
v4 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v5 = aten.cat([v3.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    def test_hca_prefill(self):
        self.assertExpectedInline(_graph(_model("heavily_compressed_attention"), "prefill"), """\
# embed
inputs: 2 tensors
# attention (heavily_compressed_attention): layer 0
inputs: 25 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=4, overlap=False, eps=1e-06)
v3 = mlagraph.hca_attention(q=v1, kv_cache=in12', compressed_cache=in21', sinks=in22, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=4, softmax_scale=0.25)
v4 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v5 = aten.cat([v3.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    def test_csa_prefill(self):
        self.assertExpectedInline(_graph(_model("compressed_sparse_attention"), "prefill"), """\
# embed
inputs: 2 tensors
# attention (compressed_sparse_attention): layer 0
inputs: 33 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v3 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v4 = aten.cat([_, v3.0], -1)
v5 = mlagraph.csa_indexer_topk(q=v4, weights=_, index_cache=in27', positions=in11, req_ids=in18, block_table=in19, page_size=_, compress_rate=2, topk=3, softmax_scale=0.25)
v6 = mlagraph.csa_attention(q=v1, kv_cache=in12', compressed_cache=in21', topk_indices=v5, sinks=in30, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=2, softmax_scale=0.25)
v7 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v8 = aten.cat([v6.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    def test_csa_dense_prefill_has_no_indexer_scoring(self):
        self.assertExpectedInline(_graph(_model("compressed_sparse_attention"), "dense_prefill"), """\
# embed
inputs: 2 tensors
# attention (compressed_sparse_attention): layer 0
inputs: 31 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v3 = mlagraph.hca_attention(q=v1, kv_cache=in12', compressed_cache=in21', sinks=in28, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=2, softmax_scale=0.25)
v4 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v5 = aten.cat([v3.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    def test_csa_decode(self):
        self.assertExpectedInline(_graph(_model("compressed_sparse_attention"), "decode"), """\
# embed
inputs: 2 tensors
# attention (compressed_sparse_attention): layer 0
inputs: 34 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
v2 = aten.cat([_, v0.1], -1)
mlagraph.swa_cache_write(kv=v2~, kv_cache=in12!, slot_mapping=in13)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v3 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v4 = aten.cat([_, v3.0], -1)
v5 = mlagraph.csa_indexer_topk(q=v4, weights=_, index_cache=in27', positions=in11, req_ids=in18, block_table=in19, page_size=_, compress_rate=2, topk=3, softmax_scale=0.25)
v6 = mlagraph.csa_decode(q=v1~, kv_cache=in12', compressed_cache=in21', topk_indices=v5~, sinks=in30, block_table=in19, seq_lens=in31, window=6, compress_rate=2, softmax_scale=0.25)
v7 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v8 = aten.cat([v6.0~, _], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")
