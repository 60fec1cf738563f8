"""DeepSeek-V4 configuration, read from a Hugging Face ``config.json`` (``model_type: deepseek_v4``).

V4 shares little with V2/V3's MLA config, so it has its own frozen dataclass. Both spellings
are read: transformers 5's (``layer_types``, ``mlp_layer_types``, ``compress_rates``, nested
``rope_parameters = {"main": ..., "compress": ...}``) and DeepSeek's older top-level keys
(``compress_ratios`` per layer, ``compress_rate_csa`` / ``_hca``, ``num_hash_layers``,
``qk_rope_head_dim``, a flat YaRN dict for the compressed layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import config_dict

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's per-layer compress_ratios


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # the one shared K=V head, and each query head
    q_lora_rank: int
    qk_rope_head_dim: int  # RoPE on the LAST this-many dims of every head
    rope_theta: float  # sliding layers: plain RoPE
    compress_rope_theta: float  # CSA / HCA layers and their compressors
    compress_rope_scaling: dict | None  # HF rope dict (YaRN) for them, or None
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_compress_rate: int
    hca_compress_rate: int
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_id: int | None

    @property
    def uses_dsa(self) -> bool:
        """CSA layers select entries with an indexer, so batches get the DSA plan (dense when
        selecting would keep everything; the engine plans it from host lengths)."""
        return CSA in self.layer_types

    @property
    def dsa_dense_max_kv_len(self) -> int:
        """The longest request whose CSA selection keeps every entry: ``index_topk`` entries of
        m tokens each, plus an open window (m - 1 tokens that close no entry yet)."""
        return self.index_topk * self.csa_compress_rate + self.csa_compress_rate - 1

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def compress_rate(self, layer: int) -> int:
        """m of the layer's compressor (0 for a sliding layer)."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.csa_compress_rate, HCA: self.hca_compress_rate}[kind]

    @classmethod
    def from_hf(cls, hf: Any) -> DeepseekV4Config:
        """From a transformers config object, a config dict, or a path to config.json / its dir."""
        d = config_dict(hf)
        if d.get("model_type") != "deepseek_v4":
            raise ValueError(f"config: model_type: expected 'deepseek_v4', got {d.get('model_type')!r}")

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"config: missing required key {key!r} for deepseek_v4")
            return d[key]

        n = int(need("num_hidden_layers"))
        head_dim = int(d.get("head_dim") or 512)
        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
        else:
            rope_dim = int(d.get("qk_rope_head_dim") or 64)
        rates = dict(d.get("compress_rates") or {})
        csa_rate = int(rates.get(CSA, d.get("compress_rate_csa") or 4))
        hca_rate = int(rates.get(HCA, d.get("compress_rate_hca") or 128))

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
        if layer_types is None:  # transformers' default: 2 HCA, then HCA / CSA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d["num_hash_layers"]) if d.get("num_hash_layers") is not None else 3
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
            main, compress = rope["main"], dict(rope["compress"])
            rope_theta = float(main.get("rope_theta", d.get("rope_theta", 10000.0)))
            if main.get("rope_type", "default") != "default":
                raise ValueError(f"config: rope_parameters['main']: expected plain RoPE, got {main['rope_type']!r}")
            compress_theta = float(compress.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        else:  # a flat dict describes the compressed layers' RoPE; sliding layers use plain RoPE
            compress = {k: v for k, v in rope.items() if k not in ("main", "compress")}
            rope_theta = float(d.get("rope_theta", 10000.0))
            compress_theta = float(d.get("compress_rope_theta", 160000.0))
            if compress.get("rope_type", compress.get("type")) == "yarn":
                # DeepSeek-V4 does not scale cos/sin by YaRN's attention factor (transformers
                # forces it to 1.0 for the same reason).
                compress.setdefault("attention_factor", 1.0)
        compress_type = compress.get("rope_type", compress.get("type", "default"))
        compress_scaling = None
        if compress_type not in ("default", None):
            compress_scaling = {k: v for k, v in compress.items() if k != "partial_rotary_factor"}
            compress_scaling["rope_type"] = compress_type
            compress_scaling["rope_theta"] = compress_theta
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None

        cfg = cls(
            model_type="deepseek_v4",
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=head_dim,
            q_lora_rank=int(need("q_lora_rank")),
            qk_rope_head_dim=rope_dim,
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            compress_rope_scaling=compress_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or 1048576),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            csa_compress_rate=csa_rate,
            hca_compress_rate=hca_rate,
            sliding_window=int(d.get("sliding_window") or 128),
            o_groups=int(d.get("o_groups") or 8),
            o_lora_rank=int(d.get("o_lora_rank") or 1024),
            index_n_heads=int(d.get("index_n_heads") or 64),
            index_head_dim=int(d.get("index_head_dim") or 128),
            index_topk=int(d.get("index_topk") or 512),
            hc_mult=int(d.get("hc_mult") or 4),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters") or 20),
            hc_eps=float(d.get("hc_eps") or 1e-6),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            n_routed_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or 0),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            scoring_func=d.get("scoring_func") or "sqrtsoftplus",
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            swiglu_limit=float(d.get("swiglu_limit") or 10.0),
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_id=eos,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                raise ValueError(f"config: {name}: expected {n} entries (num_hidden_layers), got {len(types)}")
            bad = sorted(set(types) - set(allowed))
            if bad:
                raise ValueError(f"config: {name}: expected entries in {allowed}, got {bad}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"config: qk_rope_head_dim: expected an even number <= head_dim and index_head_dim, "
                             f"got {self.qk_rope_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"config: o_groups: expected a divisor of num_attention_heads * head_dim, got {self.o_groups}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"config: num_experts_per_tok: expected 1..{self.n_routed_experts}, got {self.num_experts_per_tok}"
            )
