"""DeepSeek-V4 attention: shared K=V MQA over a sliding window with sinks, plus a compressor.

Per layer type (``config.layer_types``):

- sliding: window only;
- CSA: a compressor (rate m, overlapping windows) whose entries the lightning indexer picks
  from (top ``index_topk``), attended with the window in one softmax;
- HCA: a compressor (rate m', disjoint windows) whose entries are all attended with the window.

Every tensor op is an mlagraph op (:mod:`mlagraph.ops.swa`, :mod:`mlagraph.ops.compressor`) or
plain PyTorch. Shapes: T tokens, D hidden, H heads of Dh = head_dim, R = qk_rope_head_dim
(RoPE on the LAST R dims of a head, interleaved pairs), G output groups.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..ops import backends
from .attention import RMSNorm, contiguous_copy, per_head_matmul
from .batch import Batch
from .config_v4 import CSA, HCA, SLIDING, DeepseekV4Config


@dataclasses.dataclass
class V4LayerCache:
    """One layer's paged caches (layouts: mlagraph.ops.v4_layouts); None where the type has none.

    window [pages, page_size, Dh]; state / index_state [pages, page_size, 2C] float32 compressor
    state; compressed [pages, E, Dh]; index_keys [pages, E, index_head_dim] float32.
    """

    window: torch.Tensor
    state: torch.Tensor | None = None
    compressed: torch.Tensor | None = None
    index_state: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight, in float32 (V4's per-head query norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def _split_tail(x: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x[..., :D - r], x[..., D - r:]). ``narrow`` with the lengths, not
    ``x[..., -r:]``: r comes from the cos/sin table, a dynamic size in a compiled step, and a
    negative slice bound leaves the result's size undecided (an unbacked size) when sizes are
    traced size-oblivious."""
    d = x.shape[-1]
    return x.narrow(-1, 0, d - r), x.narrow(-1, d - r, r)


def rotate_tail(rope, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE on the last R dims of x [T, H, Dh] (and of k [T, 1, Dh] with it), interleaved pairs."""
    r = cos_sin.shape[-1]
    x_head, x_tail = _split_tail(x, r)
    k_head, k_tail = _split_tail(k, r) if k is not None else (None, x_tail[:, :1])  # the op rotates one key too
    x_rot, k_rot = rope(contiguous_copy(x_tail), contiguous_copy(k_tail), positions, cos_sin, True)
    x = torch.cat([x_head, x_rot], dim=-1)
    return x, (torch.cat([k_head, k_rot], dim=-1) if k is not None else None)


def unrotate_tail(rope, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation of :func:`rotate_tail` on x [T, H, Dh].

    Rotating by -θ is swapping each pair, rotating by θ, swapping back: with S(a, b) = (b, a),
    S·R(θ)·S = R(-θ). So the one cos/sin table serves both directions.
    """
    r = cos_sin.shape[-1]
    # Swapping pairs is a gather of the columns 1, 0, 3, 2, ...: no view of the strided tail,
    # which Inductor could not lower without asking whether T == 1 (a guard: a one-token step
    # would compile again).
    pairs = torch.arange(r, device=x.device) ^ 1
    head, tail = _split_tail(x, r)
    tail = tail.index_select(-1, pairs)
    tail = rope(tail, contiguous_copy(tail[:, :1]), positions, cos_sin, True)[0].index_select(-1, pairs)
    return torch.cat([head, tail], dim=-1)


class Compressor(nn.Module):
    """Projections of one compressor (HF names): kv_proj, gate_proj [c·W, D], position_bias [m, c·W]
    float32, kv_norm [W]; c = 2 with overlapping windows (CSA, the indexer), else 1 (HCA)."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float, backend: backends.Backend):
        super().__init__()
        c = 2 if overlap else 1
        self.rate, self.overlap, self.eps, self.width = rate, overlap, eps, width
        self.kv_proj = nn.Linear(hidden, c * width, bias=False)
        self.gate_proj = nn.Linear(hidden, c * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, c * width, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, eps)
        self._update = backend.op("compressor_update")

    def state_width(self) -> int:
        return 2 * self.kv_proj.out_features

    def forward(self, x: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, state: torch.Tensor,
                entries: torch.Tensor) -> None:
        """x [T, D]: appends the tokens to ``state`` and writes the entries they close."""
        self._update(
            self.kv_proj(x), self.gate_proj(x), self.position_bias, self.kv_norm.weight, cos_sin, batch.positions,
            batch.req_ids, batch.slot_mapping, batch.block_table, state, entries, self.rate, self.overlap, self.eps,
        )


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim (the inherited
    parameters), query heads (q_b_proj) and per-head weights (scorer.weights_proj)."""

    def __init__(self, cfg: DeepseekV4Config, backend: backends.Backend):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_compress_rate, True, cfg.rms_norm_eps, backend)
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self._rope, self._topk = backend.op("rope"), backend.op("csa_indexer_topk")

    def select(self, x: torch.Tensor, q_lora: torch.Tensor, batch: Batch, cos_sin: torch.Tensor,
               cache: V4LayerCache) -> torch.Tensor | None:
        """x [T, D], q_lora [T, Q] -> the entries each token attends: [T, index_topk] int32, or
        None when the plan is dense (every request's entries fit index_topk: selecting would keep
        them all). The indexer's keys are written either way: later sparse steps read them."""
        self(x, batch, cos_sin, cache.index_state, cache.index_keys)
        if batch.plan.dsa_dense:
            return None
        q = self.q_b_proj(q_lora).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        q, _ = rotate_tail(self._rope, q, batch.positions, cos_sin)
        weights = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [T, Hi]
        page_size = cache.window.shape[1]
        return self._topk(q, weights, cache.index_keys, batch.positions, batch.req_ids, batch.block_table, page_size,
                          self.rate, self.topk, self.head_dim**-0.5)


class V4Attention(nn.Module):
    """Parameter names are transformers' (``model.layers.{i}.self_attn.*``)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, backend: backends.Backend):
        super().__init__()
        self.kind = cfg.layer_types[layer]
        self.n_heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.rate, self.eps = cfg.sliding_window, cfg.compress_rate(layer), cfg.rms_norm_eps
        self.softmax_scale = cfg.softmax_scale
        H, Dh, G = self.n_heads, self.head_dim, self.groups
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * Dh, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, Dh, bias=False)
        self.kv_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        # Grouped low-rank output: group g maps its H·Dh/G inputs to o_lora_rank outputs with rows
        # g·o_lora_rank.. of o_a_proj; o_b_proj mixes the G·o_lora_rank results.
        self.o_a_proj = nn.Linear(H * Dh // G, G * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(G * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor = None
        if self.kind != SLIDING:
            self.compressor = Compressor(cfg.hidden_size, Dh, self.rate, self.kind == CSA, cfg.rms_norm_eps, backend)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(cfg, backend)
        self._rope, self._write = backend.op("rope"), backend.op("swa_cache_write")
        kind = {SLIDING: "swa", CSA: "csa", HCA: "hca"}[self.kind]
        self._attend, self._decode = backend.op(f"{kind}_attention"), backend.op(f"{kind}_decode")
        # A CSA step whose selection would keep every entry attends them all, as HCA does.
        self._attend_all, self._decode_all = backend.op("hca_attention"), backend.op("hca_decode")

    def forward(self, x: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, cache: V4LayerCache) -> torch.Tensor:
        """x [T, D] -> [T, D]. ``cos_sin``: the layer's RoPE table (main or compress)."""
        T, H, Dh = x.shape[0], self.n_heads, self.head_dim
        q_lora = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = unit_rms(self.q_b_proj(q_lora).view(T, H, Dh), self.eps)  # [T, H, Dh]
        kv = self.kv_norm(self.kv_proj(x))[:, None, :]  # [T, 1, Dh]: the one K=V head
        q, kv = rotate_tail(self._rope, q, batch.positions, cos_sin, kv)
        self._write(kv[:, 0], cache.window, batch.slot_mapping)

        topk = None
        if self.kind != SLIDING:
            self.compressor(x, batch, cos_sin, cache.state, cache.compressed)
            if self.kind == CSA:
                topk = self.compressor.indexer.select(x, q_lora, batch, cos_sin, cache)  # [T, K] or None
        out = self._attention(q, batch, cache, topk)  # [T, H, Dh]
        # The values carry their keys' rotation; rotating the output back by the query's own
        # position leaves each entry's contribution a function of the relative distance.
        out = unrotate_tail(self._rope, out, batch.positions, cos_sin)  # [T, H, Dh]
        grouped = out.reshape(T, self.groups, -1)  # [T, G, H·Dh/G]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, o_lora_rank, H·Dh/G]
        return self.o_b_proj(per_head_matmul(grouped, w.transpose(1, 2), flat=True))

    def _attention(self, q: torch.Tensor, batch: Batch, cache: V4LayerCache, topk: torch.Tensor | None) -> torch.Tensor:
        """The layer type's attention (all entries for a CSA layer without a selection), in its
        decode form when the plan says every request decodes the same number of tokens (the
        batch is then B requests x s_q tokens, in order)."""
        extra = () if self.kind == SLIDING else (cache.compressed,)
        rate = () if self.kind == SLIDING else (self.rate,)
        dense_csa = self.kind == CSA and topk is None
        s_q = batch.plan.decode_q_len
        if s_q:
            B = batch.num_reqs
            q4 = q.view(B, s_q, *q.shape[1:])
            sel = () if topk is None else (topk.view(B, s_q, -1),)
            op = self._decode_all if dense_csa else self._decode
            out, _ = op(q4, cache.window, *extra, *sel, self.sinks, batch.block_table, batch.seq_lens, self.window,
                        *rate, self.softmax_scale)
            return out.flatten(0, 1)
        sel = () if topk is None else (topk,)
        op = self._attend_all if dense_csa else self._attend
        out, _ = op(q, cache.window, *extra, *sel, self.sinks, batch.positions, batch.req_ids, batch.block_table,
                    self.window, *rate, self.softmax_scale)
        return out
