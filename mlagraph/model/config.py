"""DeepSeek model configuration, read from a Hugging Face ``config.json`` (V2, V3, V3.2).

One flat, frozen dataclass with every number the model needs, normalised across the three
generations and across transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters``) spellings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's contents; a ValueError naming the file (and where) when it is missing or not JSON."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path!r}: expected a JSON file, got no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{path!r}: expected valid JSON, got a parse error{where}: {getattr(e, 'msg', e)}") from None


def read_config_file(hf: Any) -> Any:
    """A path to config.json (or its directory) -> its dict; anything else is returned as is."""
    if isinstance(hf, (str, os.PathLike)):
        path = os.path.join(hf, "config.json") if os.path.isdir(hf) else hf
        config = read_json(path)
        if not isinstance(config, dict):
            raise ValueError(f"{os.fspath(path)!r}: expected a JSON object, got {type(config).__name__}")
        return config
    return hf


def config_dict(hf: Any) -> dict:
    """A HF config (transformers object, dict, or config.json path / its directory) as a new dict."""
    hf = read_config_file(hf)
    if not isinstance(hf, dict):
        hf = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    return dict(hf)


def model_type_of(hf: Any) -> str | None:
    """The ``model_type`` of a HF config (object, dict, or config.json path / its directory)."""
    hf = read_config_file(hf)
    return hf.get("model_type") if isinstance(hf, dict) else getattr(hf, "model_type", None)


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: dict | None  # HF rope dict (rope_type "yarn" ...) or None for plain RoPE
    max_position_embeddings: int
    rope_interleave: bool
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3, V3.2)
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_id: int | None
    # DSA (V3.2); index_topk == 0 means no indexer
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    # multi-token-prediction layers after the decoder layers (DeepSeek-V3 / V3.2: 1); 0 when
    # the checkpoint holds none (mlagraph.model.mtp)
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def uses_dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (0.135234 for V3)."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling or {}
        if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
            factor = s["factor"]
            m = 0.1 * s["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    # -----------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Any) -> DeepseekConfig:
        """From a transformers config object, a config dict, or a path to config.json / its dir."""
        d = config_dict(hf)
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " (DeepSeek-V4 has its own config: mlagraph.model.config_v4)" if model_type == "deepseek_v4" else ""
            raise ValueError(f"config: model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}{hint}")

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"config: missing required key {key!r} for {model_type}")
            return d[key]

        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type not in ("default", None):
            rope_scaling = {**rope, "rope_type": rope_type}
            rope_scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))

        is_v2 = model_type == "deepseek_v2"
        n_routed = int(d.get("n_routed_experts") or d.get("num_local_experts") or 0)
        # transformers' V3/V3.2 routers always use sigmoid + noaux_tc; V2 uses softmax and a
        # greedy / group-limited top-k. Original checkpoints spell these out; trust them when present.
        scoring = d.get("scoring_func") or ("softmax" if is_v2 else "sigmoid")
        topk_method = d.get("topk_method") or ("greedy" if is_v2 else "noaux_tc")
        n_group = int(d.get("n_group") or 1)
        topk_group = int(d.get("topk_group") or n_group)
        first_dense = d.get("first_k_dense_replace")
        if first_dense is None:
            mlp_types = d.get("mlp_layer_types")
            first_dense = mlp_types.index("sparse") if mlp_types and "sparse" in mlp_types else 0
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None

        cfg = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            rope_interleave=bool(d.get("rope_interleave", True)),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            n_routed_experts=n_routed,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            first_k_dense_replace=int(first_dense),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            scoring_func=scoring,
            topk_method=topk_method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            eos_token_id=eos,
            index_topk=int(d.get("index_topk") or 0) if model_type == "deepseek_v32" else 0,
            index_head_dim=int(d.get("index_head_dim") or 0),
            index_n_heads=int(d.get("index_n_heads") or 0),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config: qk_rope_head_dim: expected an even number, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"config: n_group: expected a divisor of n_routed_experts={self.n_routed_experts}, got {self.n_group}"
                )
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"config: num_experts_per_tok: expected 1..{self.n_routed_experts}, got {self.num_experts_per_tok}"
                )
        if self.uses_dsa:
            if self.q_lora_rank is None:
                raise ValueError("config: q_lora_rank: expected an int for deepseek_v32 (its indexer reads q_lora), got None")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(
                    f"config: index_head_dim: expected >= qk_rope_head_dim={self.qk_rope_head_dim}, got {self.index_head_dim}"
                )


def deepseek_v3_shaped(num_hidden_layers: int = 2, **overrides: Any) -> dict:
    """A Hugging Face config dict with DeepSeek-V3's real attention and hidden dimensions
    (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, YaRN RoPE,
    the real 129280-token vocabulary) but few layers and a small MoE (8 routed experts of
    intermediate 256, top-2, one shared expert), so it fits one GPU with room for a long cache.

    The end-to-end benchmark and the GPU example build their random models from it, and
    transformers' ``DeepseekV3Config(**deepseek_v3_shaped())`` builds the same architecture.
    ``overrides`` replace any key (say ``vocab_size`` or ``n_routed_experts``).
    """
    cfg = dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=256,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    cfg.update(overrides)
    return cfg
