"""DeepSeek-V4 for causal LM, built only from mlagraph ops and plain PyTorch.

Reads top-down: the MoE, the decoder layer (attention and MoE inside hyper-connections), the
model. Parameter names are transformers' (``DeepseekV4ForCausalLM.state_dict()``);
:func:`checkpoint_key` maps the names DeepSeek's checkpoints use on disk onto them.

Shapes: T tokens of the batch (all requests packed), N = hc_mult residual streams, D hidden
size, V vocabulary.
"""

from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import backends, v4_layouts
from ..ops.rope import rope_cos_sin_cache
from .attention import RMSNorm
from .attention_v4 import V4Attention, V4LayerCache
from .batch import Batch
from .config_v4 import CSA, HCA, DeepseekV4Config
from .hyper_connections import HyperConnection, HyperHead


class ClampedMLP(nn.Module):
    """SwiGLU with V4's clip: silu(min(gate, limit)) * clamp(up, -limit, limit). The shared expert."""

    def __init__(self, dim: int, hidden: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        return self.down_proj(F.silu(gate) * self.up_proj(x).clamp(-self.limit, self.limit))


class V4MoE(nn.Module):
    """Routed experts (one mlagraph.v4_moe op) + the shared expert. Hash layers route by token id."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, backend: backends.Backend):
        super().__init__()
        self.cfg = cfg
        self.hashed = cfg.mlp_layer_types[layer] == "hash_moe"
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32))  # the router stays float32
        if self.hashed:  # token id -> its experts, fixed at training time
            self.gate.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.experts = nn.Module()  # stacked: gate_up_proj [E, 2I, D], down_proj [E, D, I]
        self.experts.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.experts.down_proj = nn.Parameter(torch.empty(E, D, I))
        # transformers' shared expert is one MLP of moe_intermediate_size, whatever n_shared_experts says.
        self.shared_experts = ClampedMLP(D, I, cfg.swiglu_limit)
        self._moe = backend.op("v4_moe")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        bias = None if self.hashed else self.gate.e_score_correction_bias
        hash_ids = self.gate.tid2eid[input_ids] if self.hashed else None  # [T, k]
        routed = self._moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj, bias, hash_ids,
                           c.num_experts_per_tok, c.scoring_func, c.routed_scaling_factor, c.swiglu_limit)
        return routed + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    """Attention then MoE, each inside hyper-connections. A regional compile compiles the two
    blocks apart: ``attention_block`` per (``attention_kind``: the attention type, batch-plan
    variant), ``mlp_block`` per ``mlp_kind`` (hash-routed or not)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, backend: backends.Backend):
        super().__init__()
        self.layer = layer
        self.attention_kind, self.mlp_kind = cfg.layer_types[layer], cfg.mlp_layer_types[layer]
        self.compressed = cfg.layer_types[layer] != "sliding_attention"
        self.self_attn = V4Attention(cfg, layer, backend)
        self.mlp = V4MoE(cfg, layer, backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, x: torch.Tensor, batch: Batch, rope_tables: dict[str, torch.Tensor],
                cache: V4LayerCache) -> torch.Tensor:
        """x [T, N, D] residual streams -> [T, N, D]."""
        return self.mlp_block(self.attention_block(x, batch, rope_tables, cache), batch.input_ids)

    def attention_block(self, x: torch.Tensor, batch: Batch, rope_tables: dict[str, torch.Tensor],
                        cache: V4LayerCache) -> torch.Tensor:
        """x [T, N, D] -> [T, N, D]: attention merged into the residual streams."""
        cos_sin = rope_tables["compress" if self.compressed else "main"]
        h, post, comb = self.attn_hc(x)
        return HyperConnection.merge(x, self.self_attn(self.input_layernorm(h), batch, cos_sin, cache), post, comb)

    def mlp_block(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, N, D], input_ids [T] (hash routing) -> [T, N, D]: the MoE merged in."""
        h, post, comb = self.ffn_hc(x)
        return HyperConnection.merge(x, self.mlp(self.post_attention_layernorm(h), input_ids), post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, backend: backends.Backend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, backend) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 over paged window, compressor-state and compressed-entry caches.

    Same contract as :class:`~mlagraph.model.DeepseekForCausalLM` (which builds this class for
    ``model_type: deepseek_v4``): :meth:`from_config`, :meth:`from_pretrained`,
    :meth:`allocate_caches`, and ``forward(batch, caches)`` -> float32 logits
    [len(batch.logits_indices), V]. The engine's batches need nothing V4-specific.
    """

    def __init__(self, cfg: DeepseekV4Config, backend: str = "reference", kv_cache_dtype: str = "auto"):
        super().__init__()
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype: deepseek_v4 caches are unquantized for now: expected 'auto', "
                             f"got {kv_cache_dtype!r}")
        self.config = cfg
        self.backend = backends.get(backend)
        self.model = DeepseekV4Model(cfg, self.backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        R, P = cfg.qk_rope_head_dim, cfg.max_position_embeddings
        main = rope_cos_sin_cache(R, P, cfg.rope_theta, None, device="cpu")
        compress = rope_cos_sin_cache(R, P, cfg.compress_rope_theta, cfg.compress_rope_scaling,
                                      max_position_embeddings=P, device="cpu")
        self.register_buffer("rope_main", main, persistent=False)  # [P, R] float32, sliding layers
        self.register_buffer("rope_compress", compress, persistent=False)  # CSA / HCA layers
        self.dtype = torch.float32

    # --- construction --------------------------------------------------------------------

    @classmethod
    def from_config(
        cls, hf_config, *, backend: str = "reference", dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu", kv_cache_dtype: str = "auto", seed: int = 0, init_std: float | None = None,
    ) -> DeepseekV4ForCausalLM:
        """Random weights: matrices ~ N(0, init_std or initializer_range), norms 1, small random
        sinks / biases / position biases, and a random token -> experts hash table."""
        from .deepseek import _initializer_range

        cfg = DeepseekV4Config.from_hf(hf_config)
        std = init_std if init_std is not None else _initializer_range(hf_config)
        model = cls(cfg, backend=backend, kv_cache_dtype=kv_cache_dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(".scale"):
                    p.fill_(1.0)
                elif name.endswith(("sinks", "position_bias", ".base", "hc_base", "hc_scale")):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("hc_scale") else 0.0))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.rand(b.shape, generator=g) * 0.1)
                elif name.endswith("tid2eid"):  # distinct experts per token
                    b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
        return model.to_device_dtype(device, dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, backend: str = "reference", dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu", kv_cache_dtype: str = "auto", progress: bool = True,
    ) -> DeepseekV4ForCausalLM:
        """Loads a local Hugging Face checkpoint directory (config.json + *.safetensors)."""
        from .loading import load_checkpoint

        model = cls(DeepseekV4Config.from_hf(path), backend=backend, kv_cache_dtype=kv_cache_dtype)
        load_checkpoint(model, path, progress=progress)
        return model.to_device_dtype(device, dtype)

    # Parameters DeepSeek keeps in float32 whatever the model dtype (as transformers does).
    _FLOAT32 = ("mlp.gate.weight", "sinks", "position_bias", "_hc.fn", "_hc.base", "_hc.scale", "hc_head.")

    def to_device_dtype(self, device, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
        self.to(device)
        for name, p in self.named_parameters():
            if not any(k in name for k in self._FLOAT32):
                p.data = p.data.to(dtype)
        self.dtype = dtype
        return self.eval().requires_grad_(False)

    @staticmethod
    def checkpoint_key(key: str) -> str | None:
        """On-disk checkpoint name -> our parameter name (None: not part of the model)."""
        return checkpoint_key(key)

    def allocate_caches(self, num_pages: int, page_size: int) -> list[V4LayerCache]:
        """Zeroed paged caches per layer (layouts: mlagraph.ops.v4_layouts)."""
        cfg, device, dt = self.config, self.lm_head.weight.device, self.dtype

        def zeros(rows: int, width: int, dtype=dt) -> torch.Tensor:
            return torch.zeros(num_pages, rows, width, dtype=dtype, device=device)

        caches = []
        for layer in self.model.layers:
            kind, rate = layer.self_attn.kind, layer.self_attn.rate
            cache = V4LayerCache(window=zeros(page_size, cfg.head_dim))
            if kind in (CSA, HCA):
                if not v4_layouts.rates_compatible(page_size, rate):
                    raise ValueError(f"allocate_caches: page_size: expected a divisor or multiple of the "
                                     f"compress rate {rate} ({kind}), got {page_size}")
                entries = v4_layouts.entries_per_page(page_size, rate)
                comp = layer.self_attn.compressor
                cache.state = zeros(page_size, comp.state_width(), torch.float32)
                cache.compressed = zeros(entries, cfg.head_dim)
                if kind == CSA:
                    cache.index_state = zeros(page_size, comp.indexer.state_width(), torch.float32)
                    cache.index_keys = zeros(entries, cfg.index_head_dim)
            caches.append(cache)
        return caches

    # --- forward -------------------------------------------------------------------------

    def forward(self, batch: Batch, caches: list[V4LayerCache]) -> torch.Tensor:
        """One step: batch.input_ids [T] -> float32 logits [N, V] at batch.logits_indices [N]."""
        x = self.embed(batch.input_ids)
        tables = self.rope_tables()
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, batch, tables, cache)
        return self.head(x, batch.logits_indices)

    # The step's parts, as a regional compile (mlagraph/regional.py) runs them one by one.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> residual streams [T, N, D] (N copies of the embedding)."""
        h = self.model.embed_tokens(input_ids)  # [T, D]
        return h[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """x [T, N, D], logits_indices [K] -> float32 logits [K, V]."""
        h = self.model.norm(self.model.hc_head(x[logits_indices]))  # [K, D]
        return self.lm_head(h).float()

    def rope_tables(self) -> dict[str, torch.Tensor]:
        return {"main": self.rope_main, "compress": self.rope_compress}

    def attention_args(self, caches: list[V4LayerCache], i: int) -> tuple:
        """Layer i's ``attention_block`` arguments after (x, batch)."""
        return self.rope_tables(), caches[i]

    def mlp_args(self, batch: Batch) -> tuple:
        """``mlp_block`` arguments after x: the token ids (hash layers route by them)."""
        return (batch.input_ids,)


# ---------------------------------------------------------------------------------------------
# checkpoint names

# DeepSeek's on-disk names (which transformers' save_pretrained writes back) -> ours, applied in
# order to the dotted key. Each pattern is anchored on dots so it cannot hit one of our names.
_RENAMES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^(layers|norm)\.", r"model.\1."),
    (r"^model\.hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"(\.self_attn(?:\.compressor(?:\.indexer)?)?)\.norm\.", r"\1.kv_norm."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
]
_RENAMES = [(re.compile(p), r) for p, r in _RENAMES]


def checkpoint_key(key: str) -> str | None:
    """A checkpoint tensor name -> our parameter name; None for multi-token-prediction weights.

    Our own (transformers') names pass through unchanged, so both kinds of checkpoint load.
    """
    if key.startswith(("mtp.", "model.mtp.")):
        return None
    for pattern, repl in _RENAMES:
        key = pattern.sub(repl, key)
    return key
