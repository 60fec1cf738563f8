"""Golden graphs: what the passes did, pinned as canonical text (mlagraph.passes.render).

How to read one: ``inputs: N tensors`` counts the graph's tensor inputs (in0 ...); each line is
an mlagraph op (or aten.cat) in execution order, ``v3 = op(arg=value, ...)``; ``v3.1`` is its
second output, ``~`` marks a view of a value, ``_`` a value computed by ordinary aten ops,
``in14!`` a cache the op writes and ``in14'`` that cache after the write; ``# layer N`` opens a
decoder layer. After the passes, each layer's rope + cat + latent_cache_write is one
``fused_rope_concat_cache_write``; in decode graphs the concat is gone (the fused op gets a
zero-width q_nope and the decode reads q_nope and the rotated q_pe separately).

After a deliberate change: ``EXPECTTEST_ACCEPT=1 python -m pytest tests/compile/test_goldens.py``.
"""

from __future__ import annotations

import expecttest
import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import build_batch
from tests.model.conftest import hf_config


def _model(kind: str, layers: int, backend: str = "reference") -> DeepseekForCausalLM:
    cfg = hf_config(kind).to_dict()
    cfg["num_hidden_layers"] = layers
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend=backend)


def _graphs(model: DeepseekForCausalLM, kind: str, regional: bool = True) -> tuple[str, str]:
    """(before, after) canonical text of the compiled step for one batch kind: with regional
    compilation, each region it ran once (``# attention (mla): layers 0-1`` heads the graph
    every layer of that kind runs)."""
    caps, ps = model.backend.capabilities, 4
    caches = model.allocate_caches(32, ps)
    dsa = model.config.uses_dsa
    if kind == "prefill":
        batch = build_batch(caps, [[1, 2, 3, 4, 5], [6, 7]], [0, 0], [[0, 1], [2]], ps, dsa=dsa)
    elif kind == "dense_prefill":  # DSA, every kv length <= index_topk: the dense variant
        batch = build_batch(caps, [[1, 2, 3, 4, 5], [6, 7]], [0, 0], [[0, 1], [2]], ps, dsa=dsa,
                            dsa_dense_max_kv_len=model.config.index_topk)
    elif kind == "chunked":
        batch = build_batch(caps, [[1, 2, 3], [6, 7]], [4, 2], [[0, 1], [2]], ps, dsa=dsa)
    else:
        batch = build_batch(caps, [[1], [6]], [5, 2], [[0, 1], [2]], ps, is_decode=[True, True], dsa=dsa)
    torch._dynamo.reset()
    compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True, strict=True,
                                regional=regional)
    compiled(batch, caches)
    report = mlagraph.passes.last_compile()
    return report.before, report.after


class TestGoldens(expecttest.TestCase):
    def test_mla_layer_prefill(self):
        before, after = _graphs(_model("v3", 1), "prefill")
        self.assertExpectedInline(before, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 13 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
mlagraph.latent_cache_write(kv_c=_, k_pe=v0.1~, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16')
v2 = aten.cat([_, v0.1~], -1)
v3 = mlagraph.mha_prefill(q=v1, k=v2, v=_, cu_seqlens_q=in11, cu_seqlens_k=in11, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 13 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = aten.cat([_, v0.1~], -1)
v2 = mlagraph.mha_prefill(q=v0.0, k=v1, v=_, cu_seqlens_q=in11, cu_seqlens_k=in11, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_mla_layer_chunked_prefill(self):
        before, after = _graphs(_model("v3", 1), "chunked")
        self.assertExpectedInline(before, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 15 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
mlagraph.latent_cache_write(kv_c=_, k_pe=v0.1~, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16')
v2 = mlagraph.latent_cache_read(kv_cache=in9', block_table=in11, cu_seq_lens=in12, scale=None, layout='bf16', rope_dim=8, out_dtype=float32, num_tokens=_)
v3 = aten.cat([_, v2.1~], -1)
v4 = mlagraph.mha_prefill(q=v1, k=v3, v=_, cu_seqlens_q=in13, cu_seqlens_k=in12, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 15 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.latent_cache_read(kv_cache=in9', block_table=in11, cu_seq_lens=in12, scale=None, layout='bf16', rope_dim=8, out_dtype=float32, num_tokens=_)
v2 = aten.cat([_, v1.1~], -1)
v3 = mlagraph.mha_prefill(q=v0.0, k=v2, v=_, cu_seqlens_q=in13, cu_seqlens_k=in12, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_mla_layer_decode(self):
        before, after = _graphs(_model("v3", 1), "decode")
        self.assertExpectedInline(before, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 14 tensors
v0 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
mlagraph.latent_cache_write(kv_c=_, k_pe=v0.1~, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16')
v2 = mlagraph.mla_decode(q_nope=v1~, q_pe=v1~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 14 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.mla_decode(q_nope=_, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_v3_two_layers_prefill_after(self):
        _, after = _graphs(_model("v3", 2), "prefill")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layers 0-1
inputs: 13 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = aten.cat([_, v0.1~], -1)
v2 = mlagraph.mha_prefill(q=v0.0, k=v1, v=_, cu_seqlens_q=in11, cu_seqlens_k=in11, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")

    def test_v3_two_layers_prefill_whole_model(self):
        # regional=False: one graph holding both layers (each under its ``# layer N``)
        _, after = _graphs(_model("v3", 2), "prefill", regional=False)
        self.assertExpectedInline(after, """\
inputs: 46 tensors
# layer 0
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in12, cos_sin_cache=in2, kv_cache=in13!, slot_mapping=in14, scale=None, layout='bf16', interleaved=True)
v1 = aten.cat([_, v0.1~], -1)
v2 = mlagraph.mha_prefill(q=v0.0, k=v1, v=_, cu_seqlens_q=in15, cu_seqlens_k=in15, softmax_scale=0.264642, causal=True)
# layer 1
v3 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in12, cos_sin_cache=in2, kv_cache=in31!, slot_mapping=in14, scale=None, layout='bf16', interleaved=True)
v4 = aten.cat([_, v3.1~], -1)
v5 = mlagraph.mha_prefill(q=v3.0, k=v4, v=_, cu_seqlens_q=in15, cu_seqlens_k=in15, softmax_scale=0.264642, causal=True)
v6 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in36, down_proj=in37, e_score_correction_bias=in38, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in39, shared_up_proj=in40, shared_down_proj=in41)""")

    def test_v3_two_layers_decode_after(self):
        _, after = _graphs(_model("v3", 2), "decode")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layers 0-1
inputs: 14 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.mla_decode(q_nope=_, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")

    def test_v32_two_layers_prefill_after(self):
        _, after = _graphs(_model("v32", 2), "prefill")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (dsa): layers 0-1
inputs: 20 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=False)
v2 = aten.cat([v1.0, _], -1)
v3 = aten.cat([v1.1~, _], -1)
mlagraph.indexer_cache_write(k=v3, k_cache=in15!, slot_mapping=in10, layout='bf16')
v4 = mlagraph.indexer_topk(q=v2, weights=_, k_cache=in15', req_ids=in17, positions=in7, block_table=in18, layout='bf16', topk=12)
v5 = mlagraph.sparse_mla(q_nope=_, q_pe=v0.0, kv_cache=in9', topk_indices=v4, req_ids=in17, block_table=in18, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")

    def test_v32_two_layers_decode_after(self):
        _, after = _graphs(_model("v32", 2), "decode")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (dsa): layers 0-1
inputs: 20 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=False)
v2 = aten.cat([v1.0, _], -1)
v3 = aten.cat([v1.1~, _], -1)
mlagraph.indexer_cache_write(k=v3, k_cache=in15!, slot_mapping=in10, layout='bf16')
v4 = mlagraph.indexer_topk(q=v2, weights=_, k_cache=in15', req_ids=in17, positions=in7, block_table=in18, layout='bf16', topk=12)
v5 = mlagraph.sparse_mla(q_nope=_, q_pe=v0.0, kv_cache=in9', topk_indices=v4, req_ids=in17, block_table=in18, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")

    def test_v32_two_layers_dense_prefill_after(self):
        """The dense DSA variant: no indexer scoring or top-k, but the indexer keys are written."""
        _, after = _graphs(_model("v32", 2), "dense_prefill")
        self.assertNotIn("indexer_topk", after)
        self.assertIn("indexer_cache_write", after)
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (dsa): layers 0-1
inputs: 17 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=False)
v2 = aten.cat([v1.1~, _], -1)
mlagraph.indexer_cache_write(k=v2, k_cache=in14!, slot_mapping=in10, layout='bf16')
v3 = aten.cat([_, v0.1~], -1)
v4 = mlagraph.mha_prefill(q=v0.0, k=v3, v=_, cu_seqlens_q=in15, cu_seqlens_k=in15, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# mlp (moe): layer 1
inputs: 9 tensors
v0 = mlagraph.moe(hidden=_, router_logits=_, gate_up_proj=in3, down_proj=in4, e_score_correction_bias=in5, top_k=2, scoring_func='sigmoid', topk_method='noaux_tc', n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, gate_up_scale=None, down_scale=None, first_expert=None, shared_gate_proj=in6, shared_up_proj=in7, shared_down_proj=in8)
# head
inputs: 4 tensors""")

    # The triton backend: the same rewrites, into its own ops (its fused op returns K too).
    def test_triton_layer_prefill_after(self):
        _, after = _graphs(_model("v3", 1, "triton"), "prefill")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 13 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = aten.cat([_, v0.1~], -1)
v2 = mlagraph_triton.mha_prefill(q=v0.0, k=v1, v=_, cu_seqlens_q=in11, cu_seqlens_k=in11, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_triton_layer_chunked_prefill_after(self):
        _, after = _graphs(_model("v3", 1, "triton"), "chunked")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 15 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_triton.latent_cache_read(kv_cache=in9', block_table=in11, cu_seq_lens=in12, scale=None, layout='bf16', rope_dim=8, out_dtype=float32, num_tokens=_)
v2 = aten.cat([_, v1.1~], -1)
v3 = mlagraph_triton.mha_prefill(q=v0.0, k=v2, v=_, cu_seqlens_q=in13, cu_seqlens_k=in12, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_triton_layer_decode_after(self):
        _, after = _graphs(_model("v3", 1, "triton"), "decode")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 14 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_triton.mla_decode(q_nope=_, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_triton_v32_decode_after(self):
        _, after = _graphs(_model("v32", 1, "triton"), "decode")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (dsa): layer 0
inputs: 20 tensors
v0 = mlagraph_triton.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_triton.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=False)
v2 = aten.cat([v1.0, _], -1)
v3 = aten.cat([v1.1~, _], -1)
mlagraph_triton.indexer_cache_write(k=v3, k_cache=in15!, slot_mapping=in10, layout='bf16')
v4 = mlagraph_triton.indexer_topk(q=v2, weights=_, k_cache=in15', req_ids=in17, positions=in7, block_table=in18, layout='bf16', topk=12)
v5 = mlagraph_triton.sparse_mla(q_nope=_, q_pe=v0.0, kv_cache=in9', topk_indices=v4, req_ids=in17, block_table=in18, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    # The aiter backend: aiter's fused op returns no K (fused_returns_k=False), so MHA prefill,
    # which builds its keys from the rotated K, stays unfused (RoPE once, by mlagraph.rope);
    # where only the cache write needs K (MHA over the prefix read back, decode) the layer is
    # fused and the fused op's K (v0.1) is never read. aiter's decode reads q concatenated: no
    # concat is eliminated, both halves come from the fused op's q.
    def test_aiter_layer_prefill_after(self):
        _, after = _graphs(_model("v3", 1, "aiter"), "prefill")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 13 tensors
v0 = mlagraph_triton.rope(q_pe=_, k_pe=_, positions=in7, cos_sin_cache=in8, interleaved=True)
v1 = aten.cat([_, v0.0], -1)
mlagraph_triton.latent_cache_write(kv_c=_, k_pe=v0.1~, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16')
v2 = aten.cat([_, v0.1~], -1)
v3 = mlagraph_triton.mha_prefill(q=v1, k=v2, v=_, cu_seqlens_q=in11, cu_seqlens_k=in11, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_aiter_layer_chunked_prefill_after(self):
        _, after = _graphs(_model("v3", 1, "aiter"), "chunked")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 15 tensors
v0 = mlagraph_aiter.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_triton.latent_cache_read(kv_cache=in9', block_table=in11, cu_seq_lens=in12, scale=None, layout='bf16', rope_dim=8, out_dtype=float32, num_tokens=_)
v2 = aten.cat([_, v1.1~], -1)
v3 = mlagraph_triton.mha_prefill(q=v0.0, k=v2, v=_, cu_seqlens_q=in13, cu_seqlens_k=in12, softmax_scale=0.264642, causal=True)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")

    def test_aiter_layer_decode_after(self):
        _, after = _graphs(_model("v3", 1, "aiter"), "decode")
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
# attention (mla): layer 0
inputs: 14 tensors
v0 = mlagraph_aiter.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph_aiter.mla_decode(q_nope=v0.0~, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
# mlp (dense): layer 0
inputs: 5 tensors
# head
inputs: 4 tensors""")
