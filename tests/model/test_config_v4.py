"""DeepseekV4Config: transformers' spelling and DeepSeek's older keys give the same config."""

from __future__ import annotations

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.config_v4 import CSA, HCA, SLIDING, DeepseekV4Config
from mlagraph.ops.rope import rope_cos_sin_cache
from tests.model.test_oracle_v4 import v4_config

import transformers

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def test_transformers_config_is_read_as_is():
    hf = v4_config()
    cfg = DeepseekV4Config.from_hf(hf)
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert (cfg.csa_compress_rate, cfg.hca_compress_rate) == (2, 4)
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim == 8
    assert cfg.compress_rope_scaling["attention_factor"] == 1.0  # V4 does not scale cos/sin
    assert cfg.softmax_scale == hf.head_dim**-0.5


def test_legacy_deepseek_keys_give_the_same_config():
    """compress_ratios per layer, compress_rate_*, num_hash_layers, qk_rope_head_dim and a flat
    YaRN dict (DeepSeek's own config.json) read like transformers' nested form."""
    nested = v4_config().to_dict()
    legacy = {k: v for k, v in nested.items()
              if k not in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor")}
    legacy.update(compress_ratios=[0, 4, 128, 4], compress_rate_csa=2, compress_rate_hca=4, num_hash_layers=2,
                  qk_rope_head_dim=8, rope_scaling=dict(YARN))
    a, b = DeepseekV4Config.from_hf(nested), DeepseekV4Config.from_hf(legacy)
    assert a == b
    assert a.layer_types == (SLIDING, CSA, HCA, CSA)


def test_compress_rope_table_equals_transformers():
    hf = v4_config()
    cfg = DeepseekV4Config.from_hf(hf)
    rotary = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(hf)
    pos = torch.arange(40)[None]
    for label, theta, scaling in (("main", cfg.rope_theta, None), ("compress", cfg.compress_rope_theta,
                                                                   cfg.compress_rope_scaling)):
        cos, sin = rotary(torch.zeros(1), pos, layer_type=label)
        table = rope_cos_sin_cache(cfg.qk_rope_head_dim, 40, theta, scaling, max_position_embeddings=256)
        torch.testing.assert_close(table, torch.cat([cos[0], sin[0]], -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("key,value,match", [
    ("layer_types", ["sliding_attention"] * 3 + ["full_attention"], "layer_types: expected entries in"),
    ("mlp_layer_types", ["moe"] * 3, "mlp_layer_types: expected 4 entries"),
    ("o_groups", 3, "o_groups"),
    ("num_experts_per_tok", 7, "num_experts_per_tok"),
])
def test_bad_configs_raise(key, value, match):
    d = v4_config().to_dict()
    d[key] = value
    with pytest.raises(ValueError, match=match):
        DeepseekV4Config.from_hf(d)


def test_model_refuses_what_it_cannot_do():
    d = v4_config().to_dict()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        DeepseekForCausalLM.from_config(d, kv_cache_dtype="fp8")
    model = DeepseekForCausalLM.from_config(d)
    with pytest.raises(ValueError, match="page_size: expected a divisor or multiple of the compress rate 4"):
        model.allocate_caches(4, page_size=6)
