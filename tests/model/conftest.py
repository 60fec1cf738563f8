"""Tiny random DeepSeek checkpoints made by transformers (the oracle), saved and reloaded.

Weights use initializer_range 0.2, not the default 0.02: at 0.02 dropping RoPE entirely moves
logprobs by ~4e-4, so a 1e-4 comparison could not catch a broken RoPE; at 0.2 it moves them by
more than 1 (test_oracle.py::test_oracle_detects_broken_rope proves the tests have teeth).
"""

from __future__ import annotations

import pytest
import torch

import transformers  # the oracle (extra "test")

VOCAB = 96
INIT_STD = 0.2
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,  # != mscale_all_dim, so cos/sin carry a non-trivial attention factor
    "mscale_all_dim": 1.0,
}


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


def hf_config(kind: str):
    t = transformers
    if kind == "v2":  # softmax + greedy routing, no q_lora, plain RoPE
        return t.DeepseekV2Config(
            **_common(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if kind == "v2_qlora":  # softmax + group-limited greedy, with q_lora
        return t.DeepseekV2Config(
            **_common(q_lora_rank=48, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      routed_scaling_factor=1.5),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if kind == "v3":  # sigmoid + grouped top-k with correction bias, YaRN
        return t.DeepseekV3Config(
            **_common(q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
            rope_parameters=dict(YARN),
        )
    if kind == "v32":  # V3 + DSA indexer; index_topk small so sparse selection matters
        return t.DeepseekV32Config(
            **_common(q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
            rope_parameters=dict(YARN),
            index_topk=12,
            index_head_dim=32,
            index_n_heads=16,  # many heads: exact ties in the index scores become vanishingly rare
        )
    raise ValueError(kind)


_HF_CLASSES = {
    "v2": "DeepseekV2ForCausalLM",
    "v2_qlora": "DeepseekV2ForCausalLM",
    "v3": "DeepseekV3ForCausalLM",
    "v32": "DeepseekV32ForCausalLM",
}


def make_hf_model(kind: str, seed: int = 0):
    cfg = hf_config(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, _HF_CLASSES[kind])(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # transformers initialises it to zeros
                buf.copy_(torch.rand(buf.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """kind -> (transformers model, saved checkpoint dir); built once per session."""
    made = {}

    def get(kind: str):
        if kind not in made:
            model = make_hf_model(kind)
            path = tmp_path_factory.mktemp(f"ckpt_{kind}")
            model.save_pretrained(path)
            made[kind] = (model, path)
        return made[kind]

    return get


@torch.no_grad()
def hf_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log p(ids[t] | ids[:t]) for t = 1..n-1 from the transformers model: [n-1]."""
    logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()
