"""Multi-head Latent Attention (DeepSeek V2/V3) and the DSA indexer (V3.2), built from the ops.

Notation: T new tokens, H heads, L = kv_lora_rank (512), R = qk_rope_head_dim (64),
Dn = qk_nope_head_dim (128), Dv = v_head_dim (128), D = hidden size.

Every method emits the same backend-neutral front: RoPE -> concat(q) -> latent cache write,
then one attention op. The fusion passes (mlagraph.passes) rewrite that front into the backend's
fused op inside Inductor; the model itself never branches on a platform.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.backends import Backend
from .batch import Batch, ForwardMethod
from .config import DeepseekConfig
from .parallel import SINGLE, ParallelState, all_reduce


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, flat: bool = False) -> torch.Tensor:
    """x [T, H, a] @ w [H, a, b] -> [T, H, b] (``flat``: [T, H * b], contiguous), one matmul per head.

    Written so a compiled step traced at T = 8 does not recompile for a one-token batch: a
    batched matmul over heads, not ``einsum`` (its broadcasting checks guard on T == 1), and
    the flat form copies to contiguous strides before the view (``reshape`` would ask whether
    the transposed result is contiguous already, which it is only at T == 1: another guard)."""
    out = torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
    if flat:
        out = contiguous_copy(out).view(x.shape[0], -1)
    return out


def contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a view, made without asking whether the view is contiguous already:
    for a slice like ``x[..., -r:]`` of [T, H, D] that answer depends on T == 1, and asking it
    makes a compiled step guard on T (a one-token batch would recompile)."""
    return x.clone(memory_format=torch.contiguous_format)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype (as DeepSeek and transformers do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclasses.dataclass
class KVCaches:
    """The paged caches of all layers. ``latent[i]``: [num_pages, page_size, row] in ``layout``;
    ``index[i]`` (V3.2): [num_pages, page_size, row] in ``index_layout``; ``scale``: [1] float32
    per-tensor scale of the ``fp8`` layout (None otherwise)."""

    layout: str
    latent: list[torch.Tensor]
    scale: torch.Tensor | None
    index_layout: str = "bf16"
    index: list[torch.Tensor] | None = None

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]

    def of_layer(self, i: int) -> KVCaches:
        """Layer i's caches alone, as a one-layer KVCaches (the same tensors, not copies)."""
        index = None if self.index is None else [self.index[i]]
        return KVCaches(self.layout, [self.latent[i]], self.scale, self.index_layout, index)


class Indexer(nn.Module):
    """DSA lightning indexer: picks the index_topk keys each query attends to.

    Weight names follow the Hugging Face checkpoints (self_attn.indexer.*).
    """

    def __init__(self, cfg: DeepseekConfig, backend: Backend):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        # softmax scale and head averaging folded into the per-head weights (both > 0, so
        # ReLU(s * x) == s * ReLU(x) and the ranking is unchanged)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self._cache_write = backend.op("indexer_cache_write")
        self._topk = backend.op("indexer_topk")
        # The backend's rope: nothing fuses the indexer's (NeoX) RoPE, so it runs as called.
        self._rope = backend.op("rope")

    def _keys(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x [T,D] -> rotated index keys [T, head_dim]."""
        T, R = x.shape[0], self.rope_dim
        k = self.k_norm(self.wk(x))
        no_q = k.new_empty(T, 0, R)  # keys only: a rope call with no query heads
        _, k_rot = self._rope(no_q, k[:, None, :R], positions, cos_sin, False)
        return torch.cat([k_rot[:, 0], k[:, R:]], dim=-1)

    def write_keys(
        self, x: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, k_cache: torch.Tensor, layout: str
    ) -> None:
        """Only the indexer-key cache write (dense DSA steps): later sparse steps read these
        keys, so a dense step must still write them (docs/design.md rule 8)."""
        self._cache_write(self._keys(x, batch.positions, cos_sin), k_cache, batch.slot_mapping, layout)

    def select(
        self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor, req_ids: torch.Tensor,
        block_table: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, layout: str,
    ) -> torch.Tensor:
        """Scores and top-k for some tokens whose keys are already cached: [Ts, index_topk]."""
        T, R = x.shape[0], self.rope_dim
        q = self.wq_b(q_lora).view(T, self.n_heads, self.head_dim)
        no_k = q.new_zeros(T, 1, R)  # queries only (the keys are in the cache)
        q_rot, _ = self._rope(q[..., :R], no_k, positions, cos_sin, False)
        q = torch.cat([q_rot, q[..., R:]], dim=-1)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi]
        return self._topk(q, w, k_cache, req_ids, positions, block_table, layout, self.topk)

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, batch: Batch, cos_sin: torch.Tensor,
        k_cache: torch.Tensor, layout: str,
    ) -> torch.Tensor:
        """x [T,D], q_lora [T,q_lora_rank] -> top-k key positions [T, index_topk] int32 (-1 none).

        Writes this step's keys first (a token may select itself), one rope call for q and k.
        """
        T, R = x.shape[0], self.rope_dim
        q = self.wq_b(q_lora).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))  # [T, head_dim]
        # NeoX (half-split) RoPE on the first R dims, unlike the main MLA's interleaved pairs.
        q_rot, k_rot = self._rope(q[..., :R], k[:, None, :R], batch.positions, cos_sin, False)
        q = torch.cat([q_rot, q[..., R:]], dim=-1)
        k = torch.cat([k_rot[:, 0], k[:, R:]], dim=-1)
        self._cache_write(k, k_cache, batch.slot_mapping, layout)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi]
        return self._topk(q, w, k_cache, batch.req_ids, batch.positions, batch.block_table, layout, self.topk)


def _adjacent_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b's rows follow a's in one storage, both row-major with the same width."""
    return (a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1] and a.is_contiguous() and b.is_contiguous()
            and a.dtype == b.dtype and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


class MLAttention(nn.Module):
    """DeepSeek MLA. Weight names follow the Hugging Face checkpoints (self_attn.*).

    Tensor parallel (``ps.world`` > 1): this rank runs H / world of the heads (H below is the
    local count): q / kv_b hold those heads' rows, o_proj their input columns, and the block
    ends in one all-reduce. The latent projection and the indexer are replicated, so every
    rank writes the same latent cache rows and picks the same top-k."""

    def __init__(self, cfg: DeepseekConfig, backend: Backend, ps: ParallelState = SINGLE):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        H, L, R = ps.shard(cfg.num_attention_heads, "num_attention_heads")[1], cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.num_heads, self.kv_lora_rank, self.rope_dim = H, L, R
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.softmax_scale = cfg.softmax_scale
        self.interleaved = cfg.rope_interleave or cfg.model_type == "deepseek_v2"
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, L + R, bias=bias)
        # q_proj / q_a_proj and kv_a_proj_with_mqa stacked [Nq + L + R, D], set by
        # fuse_input_projections once the weights are final (the two read the same x).
        self.register_buffer("fused_input_weight", None, persistent=False)
        self.kv_a_layernorm = RMSNorm(L, 1e-6)
        self.kv_b_proj = nn.Linear(L, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.hidden_size, bias=bias)
        self.indexer = Indexer(cfg, backend) if cfg.uses_dsa else None
        # Every op from the backend (lesson 1): an eager step, and any layer a pass leaves
        # unfused, runs the backend's own RoPE and cache write; the passes match these names.
        self._rope = backend.op("rope")
        self._cache_write = backend.op("latent_cache_write")
        self._decode = backend.op("mla_decode")
        self._prefill = backend.op("mha_prefill")
        self._sparse = backend.op("sparse_mla")
        self._cache_read = backend.op("latent_cache_read")

    # --- pieces --------------------------------------------------------------------------

    @property
    def q_input_proj(self) -> nn.Module:
        """The projection of x on q's side: q_proj, or q_a_proj with a q LoRA."""
        return self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj

    def fuse_input_projections(self) -> bool:
        """One GEMM instead of two for the projections of x: q_proj (q_a_proj with a q LoRA)
        and kv_a_proj_with_mqa. Their weights become views of one stacked tensor, so memory
        does not grow and ``state_dict()`` keeps the checkpoint's names; a decode step saves a
        launch a layer. Only for bias-free ``nn.Linear`` layers of one dtype and device (fp8
        layers keep their own block-scaled GEMMs); returns whether it fused. Called again after
        the weights are replaced or moved, it stacks them anew."""
        first, kv_a = self.q_input_proj, self.kv_a_proj_with_mqa
        if not all(type(m) is nn.Linear and m.bias is None for m in (first, kv_a)) or (
                first.weight.dtype, first.weight.device) != (kv_a.weight.dtype, kv_a.weight.device):
            self.fused_input_weight = None
            return False
        n = first.weight.shape[0]
        if _adjacent_rows(first.weight, kv_a.weight):
            # already one tensor's rows (fused before, or another model's fused weights taken
            # with load_state_dict(assign=True)): view them whole, so shared weights stay shared
            stacked = first.weight.detach().as_strided((n + kv_a.weight.shape[0], first.weight.shape[1]),
                                                       first.weight.stride())
        else:
            with torch.no_grad():
                stacked = torch.cat([first.weight, kv_a.weight])  # [Nq + L + R, D]
        first.weight = nn.Parameter(stacked[:n], requires_grad=False)
        kv_a.weight = nn.Parameter(stacked[n:], requires_grad=False)
        self.fused_input_weight = stacked
        return True

    def _apply(self, fn, recurse=True):
        # .to() / .half() convert the stacked buffer and the two weights apart, which would
        # leave three tensors (twice the memory, and weights no longer views): stack anew.
        super()._apply(fn, recurse)
        if self.fused_input_weight is not None:
            self.fuse_input_projections()
        return self

    def _project_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q, kv_c, k_pe): q is q_proj(x) as [T, H, Dn + R], or q_a_proj(x)
        [T, q_lora_rank] with a q LoRA; kv_c the latent half of kv_a_proj_with_mqa(x) [T, L]
        before its norm, k_pe its RoPE half [T, 1, R].

        Each piece is a slice or a view of a contiguous tensor: Inductor's view of a slice of a
        wider row asks whether T is 1 and would recompile a one-request decode (the test
        ``test_inductor_one_request_decode_reuses_the_graphs`` holds that). So the fused q is
        taken with as_strided, whose strides need no such question."""
        T, H, L, R = x.shape[0], self.num_heads, self.kv_lora_rank, self.rope_dim
        width = self.nope_dim + R
        if self.fused_input_weight is None:
            q, kv = self.q_input_proj(x), self.kv_a_proj_with_mqa(x)
            if self.cfg.q_lora_rank is None:
                q = q.view(T, H, width)
            return q, kv[:, :L], kv.view(T, 1, L + R)[..., L:]
        y = F.linear(x, self.fused_input_weight)  # [T, Nq + L + R], contiguous
        nq = y.shape[1] - L - R
        if self.cfg.q_lora_rank is None:
            q = y.as_strided((T, H, width), (y.shape[1], width, 1))  # y is new: its storage starts at q
        else:
            q = y[:, :nq]
        return q, y[:, nq : nq + L], y.view(T, 1, nq + L + R)[..., nq + L :]

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, Dn, L] (absorbed into q), W_UV [H, Dv, L]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _expand_kv(self, kv_c: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents kv_c [S,L], k_rot [S,R] -> per-head k [S,H,Dn+R], v [S,H,Dv] for MHA."""
        S = kv_c.shape[0]
        kv = self.kv_b_proj(kv_c).view(S, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(S, self.num_heads, self.rope_dim)], dim=-1)
        return k, v

    def _dsa_split(self, x, q_lora, q, kv_cache, batch: Batch, cos_sin, caches: KVCaches, layer, w_uk, w_uv):
        """A DSA batch with short and long requests: dense MHA over the fetched prefix for the
        requests whose kv length fits in index_topk (exact), indexer + sparse MLA for the rest.
        q [T,H,Dn+R] (MHA form) -> out [T,H,Dv]."""
        T, H, R = x.shape[0], self.num_heads, self.rope_dim
        split = batch.split
        # dense requests: MHA over their cached prefix + new tokens
        q_d = q.index_select(0, split.dense_rows)
        kv_all, pe_all = self._cache_read(
            kv_cache, split.dense_block_table, split.dense_cu_seqlens_k, caches.scale, caches.layout, R,
            x.dtype, split.dense_num_kv_tokens,
        )
        k, v = self._expand_kv(kv_all, pe_all)
        out_d, _ = self._prefill(
            q_d, k, v, split.dense_cu_seqlens_q, split.dense_cu_seqlens_k, self.softmax_scale, True
        )
        # sparse requests: indexer top-k, then sparse MLA in the latent space
        rows = split.sparse_rows
        q_s = q.index_select(0, rows)
        q_abs = per_head_matmul(q_s[..., : self.nope_dim], w_uk)
        req_s = batch.req_ids.index_select(0, rows)
        topk = self.indexer.select(
            x.index_select(0, rows), q_lora.index_select(0, rows), batch.positions.index_select(0, rows),
            req_s, batch.block_table, cos_sin, caches.index[layer], caches.index_layout,
        )
        o, _ = self._sparse(
            q_abs, q_s[..., self.nope_dim :], kv_cache, topk, req_s, batch.block_table, caches.scale,
            caches.layout, self.softmax_scale,
        )
        out_s = per_head_matmul(o, w_uv.transpose(1, 2))
        out = out_d.new_zeros(T, H, self.v_dim)
        return out.index_copy(0, split.dense_rows, out_d).index_copy(0, rows, out_s)

    # --- forward -------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, batch: Batch, cos_sin: torch.Tensor, caches: KVCaches, layer: int
    ) -> torch.Tensor:
        """x [T,D] -> [T,D]. Writes this step's latents (and indexer keys) into the caches."""
        T, H, L, R = x.shape[0], self.num_heads, self.kv_lora_rank, self.rope_dim
        kv_cache = caches.latent[layer]

        q_lora = None
        q, kv_c, k_pe = self._project_input(x)  # q [T, H, Dn + R] or [T, q_lora_rank]; [T, L]; [T, 1, R]
        if self.cfg.q_lora_rank is not None:
            q_lora = self.q_a_layernorm(q)
            q = self.q_b_proj(q_lora).view(T, H, self.nope_dim + R)
        q_nope, q_pe = q.split([self.nope_dim, R], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)

        method = batch.method
        w_uk, w_uv = self._w_uk_uv()
        if method in (ForwardMethod.ABSORBED, ForwardMethod.SPARSE):
            # Absorb W_UK into q so attention runs in the latent space: [T,H,Dn] x [H,Dn,L].
            q_nope = per_head_matmul(q_nope, w_uk)

        # The backend-neutral front: RoPE -> concat -> cache write.
        q_rot, k_rot = self._rope(q_pe, k_pe, batch.positions, cos_sin, self.interleaved)
        q = torch.cat([q_nope, q_rot], dim=-1)  # [T, H, Dn+R] (MHA) or [T, H, L+R] (latent)
        self._cache_write(kv_c, k_rot[:, 0], kv_cache, batch.slot_mapping, caches.scale, caches.layout)
        if self.indexer is not None and method is not ForwardMethod.SPARSE:
            # DSA model, dense (or split) plan: keys are cached for every token, scored for none
            # (the split method scores its sparse requests' tokens below)
            self.indexer.write_keys(x, batch, cos_sin, caches.index[layer], caches.index_layout)

        if method is ForwardMethod.DSA_SPLIT:
            out = self._dsa_split(x, q_lora, q, kv_cache, batch, cos_sin, caches, layer, w_uk, w_uv)
        elif method is ForwardMethod.MHA:
            k, v = self._expand_kv(kv_c, k_rot[:, 0])
            if batch.single_request:  # one request, no prefix: the backend's dense kernel
                out, _ = self._prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_q, self.softmax_scale, True,
                                       single_request=True)
            else:
                out, _ = self._prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_q, self.softmax_scale, True)
        elif method is ForwardMethod.MHA_PREFIX:
            kv_all, pe_all = self._cache_read(
                kv_cache, batch.block_table, batch.cu_seqlens_k, caches.scale, caches.layout, R, x.dtype,
                batch.num_kv_tokens,
            )
            k, v = self._expand_kv(kv_all, pe_all)
            out, _ = self._prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.softmax_scale, True)
        else:
            if method is ForwardMethod.ABSORBED:
                # [B, s_q] split on the whole q, then the halves: the split of a strided half
                # would make Inductor guard T > 1 (a one-token decode would compile again)
                B, s_q = batch.num_reqs, batch.plan.decode_q_len
                q = q.view(B, s_q, H, L + R)
                o, _ = self._decode(
                    q[..., :L], q[..., L:], kv_cache,
                    batch.block_table, batch.seq_lens, caches.scale, caches.layout, self.softmax_scale,
                )
                o = o.reshape(T, H, L)
            else:  # SPARSE
                topk = self.indexer(x, q_lora, batch, cos_sin, caches.index[layer], caches.index_layout)
                o, _ = self._sparse(
                    q[..., :L], q[..., L:], kv_cache, topk, batch.req_ids, batch.block_table,
                    caches.scale, caches.layout, self.softmax_scale,
                )
            out = per_head_matmul(o, w_uv.transpose(1, 2), flat=True)  # latent -> per-head values [T, H * Dv]
        if out.dim() == 3:  # the MHA forms' [T, H, Dv]
            out = out.reshape(T, H * self.v_dim)
        if self.ps.world == 1:
            return self.o_proj(out)
        # Row parallel: each rank's heads give a partial sum; the bias is added once, after.
        y = all_reduce(F.linear(out, self.o_proj.weight), self.ps)
        return y if self.o_proj.bias is None else y + self.o_proj.bias
