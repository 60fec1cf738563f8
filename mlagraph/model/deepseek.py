"""DeepSeek V2 / V3 / V3.2 for causal LM, built only from mlagraph ops and plain PyTorch.

Reads top-down: MLP and MoE, the decoder layer, the model. Parameter names equal the Hugging
Face checkpoint names (routed experts are stacked; see loading.py), so ``state_dict()`` is the
checkpoint minus the per-expert split.

Shapes: T tokens of the batch (all requests packed), D hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import backends, layouts
from ..ops.rope import rope_cos_sin_cache
from .attention import KVCaches, MLAttention, RMSNorm
from .batch import Batch
from .config import DeepseekConfig, model_type_of, read_config_file
from .generation_config import eos_token_ids
from .parallel import (
    SINGLE,
    ParallelState,
    all_gather_last,
    all_reduce,
    check_divisible,
    local_slice,
    parallel_state,
    vocab_parallel_embedding,
)
from .tokenizer import Tokenizer


class MLP(nn.Module):
    """SwiGLU MLP [T,D] -> [T,D]. Tensor parallel: this rank's 1/world of the ``hidden`` width
    (gate / up rows, down columns); ``reduce=False`` returns the partial sum (a MoE's shared
    experts add theirs to the routed experts' before the layer's one all-reduce)."""

    def __init__(self, dim: int, hidden: int, ps: ParallelState = SINGLE, reduce: bool = True):
        super().__init__()
        self.ps, self.reduce = ps, reduce
        hidden = ps.shard(hidden, "the MLP's intermediate size")[1]
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return all_reduce(y, self.ps) if self.reduce else y


class Router(nn.Module):
    """The gate: float32 logits [T,E] (DeepSeek keeps the router in float32)."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """Routed experts (one mlagraph.moe op) + shared experts.

    Expert parallel (``ps.world`` > 1): this rank holds E / world routed experts (from
    ``first_expert``) and 1/world of the shared experts' width; the router is replicated, so
    every rank routes alike, and one all-reduce sums the ranks' shares."""

    def __init__(self, cfg: DeepseekConfig, backend: backends.Backend, ps: ParallelState = SINGLE):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        first, E = ps.shard(cfg.n_routed_experts, "n_routed_experts")
        self.first_expert = first if ps.world > 1 else None
        I, D = cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = Router(cfg)
        # stacked: gate_up_proj [E, 2I, D], down_proj [E, D, I]; in fp8 with scales, see fp8_weights.py
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.experts.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.shared_experts = MLP(D, I * cfg.n_shared_experts, ps, reduce=False) if cfg.n_shared_experts else None
        self._moe = backend.op("moe")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, ex = self.cfg, self.experts
        logits = self.gate(x)  # first: graph inputs keep their order (the golden graphs)
        # fp8 experts (fp8_weights.keep_experts_fp8) carry their 128x128 block scales
        fp8 = ex.gate_up_proj.dtype == torch.float8_e4m3fn
        out = self._moe(
            x, logits, ex.gate_up_proj, ex.down_proj, self.gate.e_score_correction_bias,
            c.num_experts_per_tok, c.scoring_func, c.topk_method, c.n_group, c.topk_group, c.norm_topk_prob,
            c.routed_scaling_factor,
            ex.gate_up_proj_scale_inv if fp8 else None, ex.down_proj_scale_inv if fp8 else None,
            self.first_expert, *self._shared_weights(),
        )
        return all_reduce(out, self.ps)

    def _shared_weights(self) -> tuple:
        """The shared experts for the op (it adds their MLP to the routed sum, and a backend may
        run them inside its routed kernels): gate, up, down weights, then their fp8 block scales
        (Nones for plain linears); empty without shared experts."""
        if self.shared_experts is None:
            return ()
        projs = (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj)
        return (*(p.weight for p in projs), *(getattr(p, "weight_scale_inv", None) for p in projs))


class DecoderLayer(nn.Module):
    """Attention then MLP, each a residual block. A regional compile (mlagraph/regional.py)
    compiles the two blocks apart: ``attention_block`` once per (``attention_kind``, batch-plan
    variant), ``mlp_block`` once per ``mlp_kind``, each graph shared by every layer of its kind."""

    def __init__(self, cfg: DeepseekConfig, layer: int, backend: backends.Backend, ps: ParallelState = SINGLE):
        super().__init__()
        self.layer = layer
        self.self_attn = MLAttention(cfg, backend, ps)
        moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg, backend, ps) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Layers of one kind run the same code on parameters of the same shapes.
        self.attention_kind = "dsa" if cfg.uses_dsa else "mla"
        self.mlp_kind = "moe" if moe else "dense"

    def forward(self, h: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, caches: KVCaches) -> torch.Tensor:
        """h [T,D] -> [T,D]; this layer's caches are ``caches.latent[self.layer]`` (and index)."""
        return self.mlp_block(self.attention_block(h, batch, cos_sin, caches, self.layer))

    def attention_block(self, h: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, caches: KVCaches,
                        index: int) -> torch.Tensor:
        """h [T,D] -> h + attention [T,D], over the caches at ``index`` of ``caches``."""
        return h + self.self_attn(self.input_layernorm(h), batch, cos_sin, caches, index)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """h [T,D] -> h + MLP [T,D] (reads no batch metadata: one graph for every variant)."""
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekConfig, backend: backends.Backend, ps: ParallelState = SINGLE):
        super().__init__()
        self.embed_tokens = nn.Embedding(ps.shard(cfg.vocab_size, "vocab_size")[1], cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, ps) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def head_dims(cfg: DeepseekConfig) -> dict[str, tuple[int, int]]:
    """The (qk, v) head widths each attention op of this model runs at (backends.Capabilities.head_dims)."""
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)
    return {"mha_prefill": (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim), "mla_decode": latent,
            "sparse_mla": latent}


def attention_heads(cfg: DeepseekConfig, parallel: ParallelState) -> dict[str, int]:
    """The query heads (on this rank) of each attention op the model runs (backends.Capabilities.head_counts)."""
    heads = parallel.shard(cfg.num_attention_heads, "num_attention_heads")[1]
    ops = ("mha_prefill", "mla_decode", "sparse_mla") if cfg.uses_dsa else ("mha_prefill", "mla_decode")
    return {op: heads for op in ops}


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2/V3/V3.2 over a paged latent cache.

    Build with :meth:`from_config` (random weights) or :meth:`from_pretrained` (a local Hugging
    Face directory); for ``model_type: deepseek_v4`` both return a
    :class:`~mlagraph.model.deepseek_v4.DeepseekV4ForCausalLM` (same contract, other caches). ``forward(batch, caches)`` runs one engine step and returns float32 logits
    [len(batch.logits_indices), V]; the :class:`~mlagraph.model.Engine` makes batches and caches.
    """

    def __init__(
        self, cfg: DeepseekConfig, backend: str = "reference", kv_cache_dtype: str = "auto",
        parallel: ParallelState = SINGLE, device: str | torch.device | None = None,
    ):
        super().__init__()
        self.config = cfg
        check_divisible(cfg, parallel)
        self.parallel = parallel  # tensor / expert parallel ranks (mlagraph/model/parallel.py)
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_layout = layouts.latent_layout_for(kv_cache_dtype)
        # "auto": composed for the device the model runs on and its cache layout (ops/auto.py)
        self.backend = backends.get(backend, device, self.cache_layout, head_dims(cfg), attention_heads(cfg, parallel))
        backend = self.backend.name
        if self.cache_layout not in self.backend.capabilities.latent_layouts:
            raise ValueError(
                f"kv_cache_dtype: backend {backend!r} supports cache layouts "
                f"{sorted(self.backend.capabilities.latent_layouts)}, got {kv_cache_dtype!r} ({self.cache_layout})"
            )
        if self.cache_layout == "fp8_ds" and (cfg.kv_lora_rank <= 0 or cfg.kv_lora_rank % layouts.DS_GROUP):
            # Caught here, at load, rather than by the cache ops at the first step.
            raise ValueError(
                f"kv_cache_dtype: 'fp8_ds' (one scale per {layouts.DS_GROUP} latent values; DeepSeek's 656-byte "
                f"rows) expects kv_lora_rank a multiple of {layouts.DS_GROUP} (512 for DeepSeek), got "
                f"kv_lora_rank={cfg.kv_lora_rank}; use kv_cache_dtype='fp8' or 'auto'"
            )
        # Quantized latent caches get quantized indexer keys too (DeepSeek's 132-byte rows).
        self.index_layout = "bf16" if self.cache_layout == "bf16" else "fp8"
        if cfg.uses_dsa and self.index_layout not in self.backend.capabilities.indexer_layouts:
            raise ValueError(
                f"kv_cache_dtype: backend {backend!r} supports indexer-key layouts "
                f"{sorted(self.backend.capabilities.indexer_layouts)}, got {kv_cache_dtype!r} "
                f"(indexer keys in {self.index_layout!r})"
            )
        self.model = DeepseekModel(cfg, self.backend, parallel)
        self.lm_head = nn.Linear(cfg.hidden_size, parallel.shard(cfg.vocab_size, "vocab_size")[1], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # DeepSeek's multi-token-prediction layer (speculative decoding's draft), when the
        # config has one; on one rank only for now (mlagraph/model/mtp.py)
        self.mtp = None
        if cfg.num_nextn_predict_layers and parallel.world == 1:
            from .mtp import MTPLayer

            self.mtp = MTPLayer(cfg, self.backend)
        # What generation needs from the checkpoint beyond weights (set by from_pretrained /
        # from_config): its tokenizer (None: token ids only) and end-of-sequence ids.
        self.tokenizer: Tokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = () if cfg.eos_token_id is None else (cfg.eos_token_id,)
        cos_sin = rope_cos_sin_cache(  # on the CPU: the same table whatever the device
            cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings, device="cpu",
        )
        self.register_buffer("rope_cos_sin", cos_sin, persistent=False)  # [max_pos, R] float32

    # --- construction --------------------------------------------------------------------

    def extra_repr(self) -> str:
        """The model summary's first line: the attention backend (for ``"auto"`` its composition,
        e.g. ``auto[mla_decode=flashmla,mha_prefill=flashinfer,sparse_mla=flashmla,*=triton]``)."""
        return f"backend={self.backend.name}, kv_cache_dtype={self.kv_cache_dtype!r} ({self.cache_layout})"

    @classmethod
    def from_config(
        cls, hf_config, *, backend: str = "reference", dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu", kv_cache_dtype: str = "auto", seed: int = 0, init_std: float | None = None,
        tensor_parallel_size: int = 1,
    ) -> DeepseekForCausalLM:
        """A randomly initialised model from a HF config (object, dict, or config.json path).

        Linear and embedding weights ~ N(0, init_std) (default: the config's initializer_range,
        else 0.02); norms are ones; the routing bias is small and random so it matters. On a
        CUDA device the model is built and sampled there (a DeepSeek-V3-sized model in seconds),
        so its weights differ from the CPU model of the same seed.

        ``tensor_parallel_size`` N > 1 (inside an initialized process group of N ranks): each
        rank samples the whole model with the same seed and keeps its shard, so the ranks
        together hold exactly the ``tensor_parallel_size=1`` model (the whole model is in
        memory once, briefly, per rank).
        """
        dtype, device = _as_dtype(dtype), _as_device(device)
        ps = parallel_state(tensor_parallel_size)
        if ps.world > 1:
            _no_v4_parallel(hf_config)
            full = cls.from_config(hf_config, backend=backend, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype,
                                   seed=seed, init_std=init_std)
            return full.sharded(ps)
        if model_type_of(hf_config) == "deepseek_v4":
            from .deepseek_v4 import DeepseekV4ForCausalLM

            return DeepseekV4ForCausalLM.from_config(hf_config, backend=backend, dtype=dtype, device=device,
                                                     kv_cache_dtype=kv_cache_dtype, seed=seed, init_std=init_std)
        cfg = DeepseekConfig.from_hf(hf_config)
        std = init_std if init_std is not None else _initializer_range(hf_config)
        on_gpu = torch.device(device).type == "cuda"
        with torch.device(device if on_gpu else "cpu"):
            model = cls(cfg, backend=backend, kv_cache_dtype=kv_cache_dtype, device=device)
        g = torch.Generator(device=device if on_gpu else "cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, device=g.device) * std)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.rand(b.shape, generator=g, device=g.device) * 0.1)
        model.eos_token_ids = eos_token_ids(hf_config, cfg.vocab_size)
        return model.to_device_dtype(device, dtype)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, backend: str = "reference", dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu", kv_cache_dtype: str = "auto", progress: bool = True,
        fp8_weights: str = "auto", tensor_parallel_size: int = 1,
    ) -> DeepseekForCausalLM:
        """Loads a local Hugging Face checkpoint directory (config.json + *.safetensors, and
        tokenizer.json / tokenizer_config.json / generation_config.json when present).

        ``dtype`` is a torch dtype or its name ("bfloat16"). Everything that can be checked
        before the weights are read is: the path, config.json, every shard's header, dtype,
        device and kv_cache_dtype.

        ``fp8_weights`` says what becomes of DeepSeek's fp8 block-scaled weights: "auto" keeps
        them in fp8 when config.json has an fp8 ``quantization_config`` (else dequantizes),
        "keep" keeps them or raises, "dequantize" turns them into ``dtype`` at load. Kept
        weights run as block-scaled fp8 GEMMs on CUDA and dequantize per call elsewhere
        (see mlagraph/model/fp8_weights.py).

        ``tensor_parallel_size`` N > 1 runs the model on N ranks of the initialized default
        process group (torchrun): attention heads, MLP widths and the vocabulary split N ways,
        routed experts split by expert; each rank reads only its slices of the shards. fp8
        weights stay fp8 there too, each rank keeping its slice and the slice's block scales,
        where every rank's slice is whole 128x128 blocks (DeepSeek-V3 at N = 2, 4, 8, 16); any
        other split weight is dequantized at load under "auto", and "keep" raises, naming it.
        """
        from .loading import check_shards, checkpoint_dir, checkpoint_files, has_mtp_weights, load_checkpoint

        path = checkpoint_dir(path)
        dtype, device = _as_dtype(dtype), _as_device(device)
        ps = parallel_state(tensor_parallel_size)
        if ps.world > 1:
            _no_v4_parallel(path)
        if model_type_of(path) == "deepseek_v4":
            from .deepseek_v4 import DeepseekV4ForCausalLM

            model = DeepseekV4ForCausalLM.from_pretrained(path, backend=backend, dtype=dtype, device=device,
                                                          kv_cache_dtype=kv_cache_dtype, progress=progress)
            model.tokenizer, model.eos_token_ids = Tokenizer.from_dir(path), eos_token_ids(path, model.config.vocab_size)
            return model
        cfg = DeepseekConfig.from_hf(path)
        check_shards(checkpoint_files(path))
        if cfg.num_nextn_predict_layers and not has_mtp_weights(checkpoint_files(path), cfg.num_hidden_layers):
            # transformers' save_pretrained keeps the config's count and drops the layer
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
        tokenizer, eos = Tokenizer.from_dir(path), eos_token_ids(path, cfg.vocab_size)
        model = cls(cfg, backend=backend, kv_cache_dtype=kv_cache_dtype, parallel=ps, device=device)
        load_checkpoint(model, path, progress=progress and ps.rank == 0, fp8_weights=fp8_weights, dtype=dtype)
        model.tokenizer, model.eos_token_ids = tokenizer, eos
        return model.to_device_dtype(device, dtype)

    def sharded(self, ps: ParallelState) -> DeepseekForCausalLM:
        """This (whole, world-1) model's shard for rank ``ps.rank`` of ``ps.world``: a new model
        whose parameters are this rank's slices (mlagraph/model/parallel.py says which)."""
        device = self.lm_head.weight.device
        with torch.device(device):
            part = type(self)(self.config, backend=self.backend.name, kv_cache_dtype=self.kv_cache_dtype, parallel=ps)
        full = dict(self.named_parameters())
        full.update(self.named_buffers())
        with torch.no_grad():
            for name, t in list(part.named_parameters()) + list(part.named_buffers()):
                src = full[name]
                sl = local_slice(name, src.shape, ps)
                t.copy_(src if sl is None else src.narrow(*sl))
        part.tokenizer, part.eos_token_ids = self.tokenizer, self.eos_token_ids
        return part.to_device_dtype(device, self.dtype)

    def to_device_dtype(self, device, dtype: torch.dtype) -> DeepseekForCausalLM:
        """Moves to ``device``; casts to ``dtype`` except the float32 router and RoPE table."""
        self.to(device)
        for name, p in self.named_parameters():
            if not name.endswith("mlp.gate.weight"):
                p.data = p.data.to(dtype)
        self.dtype = dtype
        for m in self.modules():  # the weights are final: stack the two projections of x
            if isinstance(m, MLAttention):
                m.fuse_input_projections()
        return self.eval().requires_grad_(False)

    def allocate_caches(self, num_pages: int, page_size: int, num_layers: int | None = None) -> KVCaches:
        """Zeroed paged caches for every layer: latent (and indexer keys for V3.2); for
        ``num_layers`` layers instead when given (the MTP layer's cache: 1)."""
        cfg, device = self.config, self.lm_head.weight.device
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        width = layouts.latent_row_width(self.cache_layout, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        dt = layouts.latent_storage_dtype(self.cache_layout, self.dtype)
        latent = [torch.zeros(num_pages, page_size, width, dtype=dt, device=device) for _ in range(n)]
        scale = torch.ones(1, dtype=torch.float32, device=device) if self.cache_layout == "fp8" else None
        index = None
        if cfg.uses_dsa:
            iw = layouts.indexer_row_width(self.index_layout, cfg.index_head_dim)
            idt = layouts.indexer_storage_dtype(self.index_layout, self.dtype)
            index = [torch.zeros(num_pages, page_size, iw, dtype=idt, device=device) for _ in range(n)]
        return KVCaches(self.cache_layout, latent, scale, self.index_layout, index)

    # --- forward -------------------------------------------------------------------------

    def forward(self, batch: Batch, caches: KVCaches) -> torch.Tensor:
        """One step: batch.input_ids [T] -> float32 logits [N, V] at batch.logits_indices [N]."""
        return self.head(self.layers_out(batch, caches), batch.logits_indices)

    # The step's parts, as a regional compile (mlagraph/regional.py) runs them one by one, and as
    # speculative decoding (mlagraph/engine/speculative.py) reads them.

    def layers_out(self, batch: Batch, caches: KVCaches) -> torch.Tensor:
        """Hidden states [T, D] after the last decoder layer (before the final norm)."""
        h = self.embed(batch.input_ids)
        for layer in self.model.layers:
            h = layer(h, batch, self.rope_cos_sin, caches)
        return h

    def hidden_states(self, batch: Batch, caches: KVCaches) -> torch.Tensor:
        """One step's final hidden states, after the final norm, at batch.logits_indices: [N, D]."""
        return self.hidden_head(self.layers_out(batch, caches), batch.logits_indices)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> hidden states [T, D]."""
        if self.parallel.world == 1:
            return self.model.embed_tokens(input_ids)
        # this rank's rows of the vocabulary, summed over ranks
        return vocab_parallel_embedding(input_ids, self.model.embed_tokens.weight, self.parallel)

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """h [T, D], logits_indices [N] -> float32 logits [N, V]."""
        return self.logits(self.hidden_head(h, logits_indices))

    def hidden_head(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """h [T, D], logits_indices [N] -> the final norm's output [N, D] (what the MTP layer reads)."""
        return self.model.norm(h[logits_indices])

    def target_head(self, h: torch.Tensor, logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D], logits_indices [N] -> (float32 logits [N, V], normed hidden states [N, D]):
        a speculative verify step's outputs (mlagraph.model.mtp.target_step)."""
        hn = self.hidden_head(h, logits_indices)
        return self.logits(hn), hn

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, D] (normed) -> float32 logits [N, V]."""
        # tensor parallel: [N, V/world] per rank, gathered to [N, V] on every rank
        return all_gather_last(self.lm_head(h), self.parallel).float()

    def attention_args(self, caches: KVCaches, i: int) -> tuple:
        """Layer i's ``attention_block`` arguments after (h, batch): the RoPE table and its own
        caches alone (a one-layer KVCaches at index 0), so every layer's call looks alike."""
        return self.rope_cos_sin, caches.of_layer(i), 0

    def mlp_args(self, batch: Batch) -> tuple:
        """``mlp_block`` arguments after h: none (V4's hash layers take the token ids)."""
        return ()


_DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def _as_dtype(dtype) -> torch.dtype:
    """A floating torch dtype, or its name ("bfloat16", "torch.bfloat16", "bf16")."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise ValueError(f"dtype: expected a torch floating dtype or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        return _DTYPE_NAMES[key]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a torch floating dtype or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
    return dtype


def _as_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch device or its name ('cpu', 'cuda:0'), got {device!r} ({e})") from None


def _no_v4_parallel(hf_config) -> None:
    if model_type_of(hf_config) == "deepseek_v4":
        raise ValueError("tensor_parallel_size: DeepSeek-V4 runs on one rank for now, expected 1")


def _initializer_range(hf_config) -> float:
    hf_config = read_config_file(hf_config)
    if isinstance(hf_config, dict):
        return float(hf_config.get("initializer_range", 0.02))
    return float(getattr(hf_config, "initializer_range", 0.02))
