"""Golden graphs of DeepSeek-V4's layers (how to read them: tests/compile/test_goldens.py).

``fuse_v4_rope_window_write`` turns the layer's front (one ``rope`` of the q and K=V tails, the
two concats, the window write) into the backend's ``fused_rope_concat_cache_write`` with layout
``bf16`` (exactly once per layer: the report says so), and the lints pass on the result. The
goldens pin that and the rest of what the model emits per layer type and plan: the compressors
(two in a CSA layer: its own and the indexer's), the indexer's
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


def _model(layer_type: str, backend: str = "reference") -> DeepseekForCausalLM:
    cfg = v4_config(num_hidden_layers=1, layer_types=[layer_type], mlp_layer_types=["moe"]).to_dict()
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend=backend)


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
    fused = [(r.pass_name, r.layer, r.count) for r in report.records if r.pass_name == "fuse_v4_rope_window_write"]
    assert fused == [("fuse_v4_rope_window_write", 0, 1)]
    assert "swa_cache_write" in report.before and "swa_cache_write" not in report.after
    return report.after


class TestV4Goldens(expecttest.TestCase):
    def test_sliding_prefill(self):
        self.assertExpectedInline(_graph(_model("sliding_attention"), "prefill"), """\
# embed
inputs: 2 tensors
# attention (sliding_attention): layer 0
inputs: 19 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.swa_attention(q=v0.0, kv_cache=in12', sinks=in14, positions=in11, req_ids=in15, block_table=in16, window=6, softmax_scale=0.25)
v2 = mlagraph.rope(q_pe=v1.0~, k_pe=v1.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v3 = aten.cat([v1.0~, v2.0~], -1)
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
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.swa_decode(q=v0.0~, kv_cache=in12', sinks=in15, block_table=in14, seq_lens=in16, window=6, softmax_scale=0.25)
v2 = mlagraph.rope(q_pe=v1.0~, k_pe=v1.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v3 = aten.cat([v1.0~, v2.0~], -1)
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
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=4, overlap=False, eps=1e-06)
v1 = mlagraph.hca_attention(q=v0.0, kv_cache=in12', compressed_cache=in21', sinks=in22, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=4, softmax_scale=0.25)
v2 = mlagraph.rope(q_pe=v1.0~, k_pe=v1.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v3 = aten.cat([v1.0~, v2.0~], -1)
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
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v1 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v2 = aten.cat([_, v1.0], -1)
v3 = mlagraph.csa_indexer_topk(q=v2, weights=_, index_cache=in27', positions=in11, req_ids=in18, block_table=in19, page_size=_, compress_rate=2, topk=3, softmax_scale=0.25)
v4 = mlagraph.csa_attention(q=v0.0, kv_cache=in12', compressed_cache=in21', topk_indices=v3, sinks=in30, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=2, softmax_scale=0.25)
v5 = mlagraph.rope(q_pe=v4.0~, k_pe=v4.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v6 = aten.cat([v4.0~, v5.0~], -1)
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
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v1 = mlagraph.hca_attention(q=v0.0, kv_cache=in12', compressed_cache=in21', sinks=in28, positions=in11, req_ids=in18, block_table=in19, window=6, compress_rate=2, softmax_scale=0.25)
v2 = mlagraph.rope(q_pe=v1.0~, k_pe=v1.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v3 = aten.cat([v1.0~, v2.0~], -1)
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
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v1 = mlagraph.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v2 = aten.cat([_, v1.0], -1)
v3 = mlagraph.csa_indexer_topk(q=v2, weights=_, index_cache=in27', positions=in11, req_ids=in18, block_table=in19, page_size=_, compress_rate=2, topk=3, softmax_scale=0.25)
v4 = mlagraph.csa_decode(q=v0.0~, kv_cache=in12', compressed_cache=in21', topk_indices=v3~, sinks=in30, block_table=in19, seq_lens=in31, window=6, compress_rate=2, softmax_scale=0.25)
v5 = mlagraph.rope(q_pe=v4.0~, k_pe=v4.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v6 = aten.cat([v4.0~, v5.0~], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")

    # The triton backend: its fused kernel takes the front, its kernel the decode attention; the
    # compressors and the indexer are the reference ops (declared fallbacks).
    def test_triton_csa_decode(self):
        self.assertExpectedInline(_graph(_model("compressed_sparse_attention", "triton"), "decode"), """\
# embed
inputs: 2 tensors
# attention (compressed_sparse_attention): layer 0
inputs: 34 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in11, cos_sin_cache=in10, kv_cache=in12!, slot_mapping=in13, scale=None, layout='bf16', interleaved=True)
mlagraph_triton.compressor_update(kv=_, gate=_, position_bias=in16, norm_weight=in17, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in20!, compressed_cache=in21!, compress_rate=2, overlap=True, eps=1e-06)
mlagraph_triton.compressor_update(kv=_, gate=_, position_bias=in24, norm_weight=in25, cos_sin_cache=in10, positions=in11, req_ids=in18, slot_mapping=in13, block_table=in19, state_cache=in26!, compressed_cache=in27!, compress_rate=2, overlap=True, eps=1e-06)
v1 = mlagraph_triton.rope(q_pe=_, k_pe=_, positions=in11, cos_sin_cache=in10, interleaved=True)
v2 = aten.cat([_, v1.0], -1)
v3 = mlagraph_triton.csa_indexer_topk(q=v2, weights=_, index_cache=in27', positions=in11, req_ids=in18, block_table=in19, page_size=_, compress_rate=2, topk=3, softmax_scale=0.25)
v4 = mlagraph_triton.csa_decode(q=v0.0~, kv_cache=in12', compressed_cache=in21', topk_indices=v3~, sinks=in30, block_table=in19, seq_lens=in31, window=6, compress_rate=2, softmax_scale=0.25)
v5 = mlagraph_triton.rope(q_pe=v4.0~, k_pe=v4.0~, positions=in11, cos_sin_cache=in10, interleaved=True)
v6 = aten.cat([v4.0~, v5.0~], -1)
# mlp (moe): layer 0
inputs: 12 tensors
v0 = mlagraph.v4_moe(hidden=_, router_logits=_, gate_up_proj=in7, down_proj=in8, e_score_correction_bias=in6, hash_ids=None, top_k=2, scoring_func='sqrtsoftplus', routed_scaling_factor=1.5, swiglu_limit=2)
# head
inputs: 7 tensors""")
