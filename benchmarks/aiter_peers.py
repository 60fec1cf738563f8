"""AMD aiter's Triton MLA kernels as peers: thin wrappers that take mlagraph-format inputs.

A benchmark times these next to mlagraph's own kernels. Each wrapper has

- a ``prepare_*`` function that converts what the peer needs in another format (cos/sin tables,
  kv_indptr/kv_indices, global slot indices, packed fp8 keys, scratch buffers) ONCE, outside
  the timed region, the way a serving engine builds its per-step metadata;
- the wrapper itself, which only launches aiter's kernel(s) (plus, where noted, a cheap view
  or an elementwise map back to mlagraph's output format);
- a ``check_*`` function that runs the wrapper and mlagraph's reference op (float32 math on a
  CPU copy) on the same inputs and returns the max error, to verify a peer before timing it;
- a ``*_runner`` that prepares everything and hands back a zero-argument callable returning
  what mlagraph's op returns (benchmarks/kernels.py times these).

Peers: ``fused_rope_cache`` (fused_kv_cache.fused_qk_rope_cat_and_cache_mla), ``mla_decode``
(mla_decode_rope.decode_attention_fwd_grouped_rope, aiter's only Triton MLA decode),
``sparse_mla`` (unified_attention_sparse_mla), ``indexer_logits`` / ``indexer_topk``
(fp8_mqa_logits over packed keys, or the paged decode kernel of pa_mqa_logits, + topk).

Each docstring states aiter's contract as read in amd-aiter 0.1.7.post2.dev18 (layouts, what is
returned, what is mutated, which outputs stay empty), and where it differs from mlagraph's op.

Errors are "max |got - want| / max |want|" over the compared entries (NaN reads as inf).

aiter is imported on first use through :func:`mlagraph.ops.aiter.load`, which skips aiter's
ROCm-only package ``__init__`` off ROCm, so this file imports without aiter installed; call
``mlagraph.ops.aiter.available()`` to ask first. aiter's kernels run on CUDA tensors (Hopper
included) and, for float32/fp8 inputs, under Triton's CPU interpreter (TRITON_INTERPRET=1);
bf16 inputs are wrong in the interpreter of Triton 3.9 (bf16 negation and bf16 ``tl.dot`` are
miscomputed there), so CPU checks use float32.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

# Importing mlagraph.ops registers the reference ops (torch.ops.mlagraph.*) the checks use.
from mlagraph.ops import aiter as _aiter
from mlagraph.ops import layouts

FP8_MAX = 448.0


@functools.lru_cache(maxsize=None)
def _load(module: str):
    """aiter.ops.triton.<module>, looked up once (keeps the loader's checks out of timed calls)."""
    return _aiter.load(module)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in float32 on the CPU; NaN or inf anywhere -> inf."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.numel() == 0:
        return 0.0
    diff = (got - want).abs().max()
    err = float(diff / want.abs().max().clamp_min(1e-30))
    return err if err == err and err != float("inf") else float("inf")


def _joined_q(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[..., L] and [..., R] -> one [..., L+R] tensor with unit last stride, as aiter reads q.

    When the two are adjacent views of one buffer (``q = torch.cat(...)`` then
    ``q[..., :L], q[..., L:]``, which is what aiter's fused RoPE op produces) this is a free
    view; otherwise it is a ``torch.cat`` copy, counted in the peer's time.
    """
    lat, rope = q_nope.shape[-1], q_pe.shape[-1]
    adjacent = (
        q_nope.dtype == q_pe.dtype and q_nope.device == q_pe.device
        and q_nope.shape[:-1] == q_pe.shape[:-1] and q_nope.stride() == q_pe.stride()
        and q_nope.stride(-1) == 1 and q_nope.untyped_storage().data_ptr() == q_pe.untyped_storage().data_ptr()
        and q_pe.data_ptr() == q_nope.data_ptr() + lat * q_nope.element_size()
        and all(s >= lat + rope for s, n in zip(q_nope.stride()[:-1], q_nope.shape[:-1]) if n > 1)
    )
    if adjacent:
        return q_nope.as_strided((*q_nope.shape[:-1], lat + rope), q_nope.stride())
    return torch.cat([q_nope, q_pe], dim=-1)


def _flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_pages, page_size, W] -> [num_pages * page_size, 1, W] (aiter's one-KV-head rows)."""
    return kv_cache.view(-1, 1, kv_cache.shape[-1])


# ---------------------------------------------------------------------------------------------
# fused RoPE -> concat -> latent cache write


def prepare_fused_rope_cache(cos_sin_cache: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Our cos/sin table [max_pos, R] (cos | sin halves) -> aiter's (cos, sin), each [max_pos, R/2].

    aiter takes cos and sin as two tensors read through (stride(0), stride(-1)); a last dim of
    R/2 means "the same angle for both members of a pair" (its ``reuse_freqs_front_part``).
    float32 (the default) keeps the rotation bit-compatible with mlagraph's reference (the
    kernel computes ``x * cos + rot(x) * sin`` in the promoted dtype); pass the model dtype to
    time aiter the way its callers usually feed it.
    """
    half = cos_sin_cache.shape[-1] // 2
    return cos_sin_cache[:, :half].to(dtype).contiguous(), cos_sin_cache[:, half:].to(dtype).contiguous()


def fused_rope_cache(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, interleaved,
                     scale=None):
    """aiter's ``fused_kv_cache.fused_qk_rope_cat_and_cache_mla`` on mlagraph's inputs.

    Args (mlagraph's ``fused_rope_concat_cache_write`` with layout "bf16"):
        q_nope [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, 1, R] (not rotated), one dtype;
        positions [T] int; cos_sin_cache: the (cos, sin) pair from
        :func:`prepare_fused_rope_cache`; kv_cache [num_pages, page_size, L + R] (pages dense),
        written in place; slot_mapping [T] int (-1 skips the token); interleaved: True for
        GPT-J pairs (DeepSeek), False for NeoX halves. ``scale``: optional [1] float32 per-tensor
        k scale (aiter stores ``x / scale`` cast to the cache dtype, e.g. an e4m3 "fp8" cache).

    Returns:
        q [T, H, L + R] = cat(q_nope, rope(q_pe)), a new tensor in q_nope's dtype.

    aiter's contract (what this calls): ``fused_qk_rope_cat_and_cache_mla(q_nope [B, QH, Dn],
    q_pe [B, QH, R], k_nope [Bk, KH, Dk], k_pe [Bk, KH, R], kv_cache [slots, KH, Dk + R],
    slot_mapping [Bs], pos [B], cos, sin, k_scale, is_neox, num_decode_toks_for_zeros=0, ...)``
    with one program per (q token, q head) plus one per extra k token, ``num_warps=1``:

    - rotates q_pe and k_pe itself (GPT-J or NeoX) in float32, and writes
      ``kv_cache[slot] = cat(k_nope, rope(k_pe)) / k_scale`` (k_scale only when given) for
      every slot >= 0, for KV head ``qh // (QH/KH)``; the cache is addressed as flat slots
      ``[slots, KH, D]``, i.e. page size 1 (a paged cache must be viewed flat, as done here);
      no fp8_ds layout, no per-group scales.
    - returns (q_out [B, QH, Dn + R], decode_q_pe_out, k_pe_out [Bk, KH, R], kv_cache), plus
      q_nope_zeros_out when num_decode_toks_for_zeros > 0. decode_q_pe_out is an EMPTY
      [0, QH, R] tensor unless num_decode_toks_for_zeros > 0 (then it holds the first tokens'
      rotated q_pe, and q_nope_zeros_out [n, QH, Dk] zeros). k_pe_out (rotated k_pe) is
      written only for tokens whose slot is >= 0: rows of skipped tokens are uninitialized
      memory (torch.empty). kv_cache is returned as the same tensor, mutated.
    - tokens Bk > B (its "prefill + decode mixed" mode, q for the first B tokens only): the k of
      tokens B..Bs-1 is written to the cache WITHOUT rotation (it assumes those were rotated
      before); tokens Bs..Bk-1 are not touched at all. Here B = Bk = Bs = T, so every token is
      rotated.
    - its host wrapper builds a logging f-string on every call (shapes only), a few µs of host
      time that CUDA-graph replay removes.
    """
    fused = _load("fused_kv_cache")
    cos, sin = cos_sin_cache
    q, _, _, _ = fused.fused_qk_rope_cat_and_cache_mla(
        q_nope, q_pe, kv_c.unsqueeze(1), k_pe, _flat_cache(kv_cache), slot_mapping, positions, cos, sin,
        scale, not interleaved,
    )
    return q


def check_fused_rope_cache(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping,
                           interleaved) -> float:
    """Max error of :func:`fused_rope_cache` against ``torch.ops.mlagraph.fused_rope_concat_cache_write``
    (layout "bf16", float32 math on CPU copies), over q and the whole cache after the write.

    ``cos_sin_cache`` is OUR table [max_pos, R] float32; ``kv_cache`` is not modified (both
    sides write into copies).
    """
    cache = kv_cache.clone()
    q = fused_rope_cache(q_nope, q_pe, kv_c, k_pe, positions, prepare_fused_rope_cache(cos_sin_cache), cache,
                         slot_mapping, interleaved)
    qn, qp, kc, kp = (t.detach().float().cpu() for t in (q_nope, q_pe, kv_c, k_pe))
    ref_cache = kv_cache.detach().float().cpu().clone()
    q_ref, _ = torch.ops.mlagraph.fused_rope_concat_cache_write(
        qn, qp, kc, kp, positions.cpu(), cos_sin_cache.float().cpu(), ref_cache, slot_mapping.cpu(), None, "bf16",
        interleaved,
    )
    return max(_rel_err(q, q_ref), _rel_err(cache, ref_cache))


# ---------------------------------------------------------------------------------------------
# MLA decode


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Knobs of aiter's two decode kernels (aiter's own per-GPU JSON configs are AMD-only).

    block_h: heads per program in stage 1 (>= 16 for tl.dot; the H200 anchor used 16).
    block_n: keys per inner step of stage 1. num_kv_splits: KV splits per request (anchor: 8).
    num_warps/num_stages: stage 1 launch options; stage2_*: those of the reduction kernel.
    The anchor's BLOCK_N / warps / stages were not recorded; the defaults are aiter's MI300
    config without its AMD-only keys (waves_per_eu, matrix_instr_nonkdim, kpack), which
    NVIDIA Triton rejects. Sweep them.
    """

    block_h: int = 16
    block_n: int = 32
    num_kv_splits: int = 8
    num_warps: int = 4
    num_stages: int = 1
    stage2_num_warps: int = 4
    stage2_num_stages: int = 2

    def aiter_dict(self) -> dict:
        return {
            "fwd_grouped_kernel_stage1_rope": {"BLOCK_H": self.block_h, "BLOCK_N": self.block_n,
                                               "num_warps": self.num_warps, "num_stages": self.num_stages},
            "fwd_kernel_stage2": {"num_warps": self.stage2_num_warps, "num_stages": self.stage2_num_stages},
        }


@dataclasses.dataclass
class DecodePlan:
    """What :func:`prepare_decode` builds: aiter's metadata and scratch for one batch shape."""

    kv_cache_ptr: int
    k_buffer: torch.Tensor  # [num_pages * page_size, 1, L + R] view of the cache (page size 1)
    v_buffer: torch.Tensor  # [num_pages * page_size, 1, L] view of the same rows
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [sum of kept keys] int32 (int64 if slot * row width can pass 2^31)
    attn_logits: torch.Tensor  # [B, H, num_kv_splits, L + 1] float32 scratch
    out: torch.Tensor  # [B, H, L] in q's dtype, overwritten by every call
    kv_lora_rank: int
    rope_dim: int
    config: DecodeConfig
    aiter_config: dict


def prepare_decode(q_nope, kv_cache, block_table, seq_lens, config: DecodeConfig | None = None) -> DecodePlan:
    """Builds aiter's decode metadata from mlagraph's paged batch (host work, outside timing).

    aiter's decode reads keys through a flat token index (page size 1): request b's keys are
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, each a row of the flat cache view. This maps
    positions 0..seq_lens[b]-1 through the block table; positions on page -1 are dropped (our
    reference masks them too), so the result is exact for any page size. Syncs (reads
    block_table / seq_lens on the host), so call it before timing or capture.

    Args:
        q_nope [B, 1, H, L]: only its shape and dtype are used. kv_cache [num_pages, page_size,
        L + R] ("bf16" layout, pages dense); block_table [B, P] int32; seq_lens [B] int32;
        config: :class:`DecodeConfig` (default: BLOCK_H 16, 8 splits).
    """
    config = config or DecodeConfig()
    if config.block_h < 16:
        raise ValueError(f"DecodeConfig.block_h: expected >= 16 (tl.dot needs 16 rows), got {config.block_h}")
    batch, _, heads, lat = q_nope.shape
    page_size, width = kv_cache.shape[1], kv_cache.shape[2]
    table, lens = block_table.cpu().long(), seq_lens.cpu().long()
    indices, indptr = [torch.empty(0, dtype=torch.long)], [0]
    for b in range(batch):
        pos = torch.arange(int(lens[b]))
        pages = table[b, (pos // page_size).clamp(max=table.shape[1] - 1)]
        keep = (pages >= 0) & (pos < table.shape[1] * page_size)
        indices.append((pages * page_size + pos % page_size)[keep])
        indptr.append(indptr[-1] + int(keep.sum()))
    # The kernel multiplies a loaded index by the row stride in the index's dtype.
    idx_dtype = torch.int32 if kv_cache.shape[0] * page_size * width < 2**31 else torch.int64
    dev = kv_cache.device
    k_buffer = _flat_cache(kv_cache)
    return DecodePlan(
        kv_cache_ptr=kv_cache.data_ptr(),
        k_buffer=k_buffer,
        v_buffer=k_buffer[..., :lat],
        kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=dev),
        kv_indices=torch.cat(indices).to(device=dev, dtype=idx_dtype),
        attn_logits=torch.empty(batch, heads, config.num_kv_splits, lat + 1, dtype=torch.float32, device=dev),
        out=torch.empty(batch, heads, lat, dtype=q_nope.dtype, device=dev),
        kv_lora_rank=lat,
        rope_dim=width - lat,
        config=config,
        aiter_config=config.aiter_dict(),
    )


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, config=None, *, plan=None):
    """aiter's ``mla_decode_rope.decode_attention_fwd_grouped_rope`` (s_q = 1) on mlagraph's inputs.

    Args (mlagraph's ``mla_decode`` with layout "bf16"): q_nope [B, 1, H, L], q_pe [B, 1, H, R]
    (already rotated), kv_cache [num_pages, page_size, L + R], block_table [B, P] int32,
    seq_lens [B] int32, softmax_scale. ``config``: a :class:`DecodeConfig`. ``plan``: from
    :func:`prepare_decode` for these same cache/table/lengths; without it the plan is built
    here (a host sync: fine for a check, wrong for timing).

    Returns:
        out [B, 1, H, L] in q's dtype: a view of ``plan.out``, overwritten by the next call. No
        lse (aiter does not produce one). Requests with seq_len 0 get NaN (aiter divides 0/0),
        where mlagraph's op returns 0.

    q is read as one [B, H, L + R] tensor: if q_nope and q_pe are adjacent views of one buffer
    (see :func:`_joined_q`) no copy is made, else a cat copy is part of the timed call.

    aiter's contract: ``decode_attention_fwd_grouped_rope(q [B, H, L+R], k_buffer [N, KH, L+R],
    v_buffer [N, KH, L], o [B, H, L] (caller-allocated, written), kv_indptr [B+1],
    kv_indices [nnz], k_pe_tokens, kv_lora_rank, rotary_dim, cos_sin_cache, positions,
    attn_logits [B, H, splits, L+1] float32 (scratch, written), num_kv_splits, sm_scale,
    logit_cap=0, use_rope=False, is_neox_style=False, config)``; last dims must be contiguous
    (only stride(0)/stride(1) are passed). Stage 1 (grid cdiv(H, min(BLOCK_H, H/KH)) * B *
    splits) runs flash-decoding over each split of each request's keys with three tl.dot
    (q_pe·k_pe, q_nope·kv, p·v; it loads every cached row twice, as K^T and as V) and stores
    the split's normalized partial output and its lse in attn_logits[..., :L] / [..., L];
    stage 2 (grid B * H) merges the splits into o. The batch size and head count are
    tl.constexpr in both kernels: every new B compiles new kernels (warm up each B before
    timing; a serving engine would pad B to buckets). Options: BLOCK_H, BLOCK_N, num_kv_splits,
    logit_cap (tanh soft cap), and use_rope: with it, the kernel rotates q_pe itself (the q it
    reads is NOT rotated) and the LAST key of each request (the cache must hold that token's
    k_pe unrotated), writing the rotated k_pe to k_pe_tokens [B, R] but NOT back to the cache
    (the caller writes it); cos_sin_cache is then [max_pos, rotary_dim] with cos | sin halves
    like ours. This wrapper uses use_rope=False (mlagraph rotates before the cache write).
    """
    if q_nope.shape[1] != 1:
        raise ValueError(f"aiter mla_decode: s_q must be 1 (aiter's decode has no multi-token causal mode), "
                         f"got q_nope shape {list(q_nope.shape)}")
    if plan is None:
        plan = prepare_decode(q_nope, kv_cache, block_table, seq_lens, config)
    elif config is not None and config != plan.config:
        raise ValueError("aiter mla_decode: config differs from the plan's; pass it to prepare_decode")
    if plan.kv_cache_ptr != kv_cache.data_ptr():
        raise ValueError("aiter mla_decode: the plan was prepared for another kv_cache")
    if plan.kv_lora_rank != q_nope.shape[-1]:
        raise ValueError(f"aiter mla_decode: plan has L={plan.kv_lora_rank}, q_nope has {q_nope.shape[-1]}")
    decode = _load("mla_decode_rope")
    q = _joined_q(q_nope, q_pe)[:, 0]  # [B, H, L + R]
    decode.decode_attention_fwd_grouped_rope(
        q, plan.k_buffer, plan.v_buffer, plan.out, plan.kv_indptr, plan.kv_indices, None,
        plan.kv_lora_rank, plan.rope_dim, None, None, plan.attn_logits, plan.config.num_kv_splits,
        float(softmax_scale), use_rope=False, config=plan.aiter_config,
    )
    return plan.out.unsqueeze(1)


def check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, config=None) -> float:
    """Max error of :func:`mla_decode` against ``torch.ops.mlagraph.mla_decode`` (float32 on CPU),
    over the requests with seq_len > 0 (aiter returns NaN for empty ones; see mla_decode)."""
    out = mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, config).clone()
    ref, _ = torch.ops.mlagraph.mla_decode(
        q_nope.float().cpu(), q_pe.float().cpu(), kv_cache.float().cpu(), block_table.cpu(), seq_lens.cpu(),
        None, "bf16", float(softmax_scale),
    )
    keep = seq_lens.cpu() > 0
    return _rel_err(out.cpu()[keep], ref[keep])


# ---------------------------------------------------------------------------------------------
# DSA sparse MLA


@dataclasses.dataclass
class SparsePlan:
    """What :func:`prepare_sparse` builds."""

    kv_cache_ptr: int
    slots: torch.Tensor  # [T, K] int32 global cache slots (page * page_size + offset), -1 = none
    cu_seqlens_q: torch.Tensor  # [2] int32: all tokens as one query sequence (see sparse_mla)
    seqused_k: torch.Tensor  # [1] int32 (unused by the kernel)
    max_seqlen_q: int  # 1 when every request has one token (aiter's ALL_DECODE), else T
    max_seqlen_k: int


def sparse_slots(topk_indices, req_ids, block_table, page_size):
    """mlagraph's per-request key positions -> aiter's global cache slots (-1 where invalid).

    Positions < 0, past the block table, or on page -1 all become -1. Plain torch gathers, no
    sync; used by :func:`prepare_sparse`, and usable inside a timed region to count it.
    """
    max_len = block_table.shape[1] * page_size
    pos = topk_indices.long()
    inside = (pos >= 0) & (pos < max_len)
    pos = pos.clamp(0, max(max_len - 1, 0))
    page = block_table.long()[req_ids.long()[:, None], pos // page_size]
    slot = page * page_size + pos % page_size
    return torch.where(inside & (page >= 0), slot, -1).to(torch.int32)


def prepare_sparse(kv_cache, topk_indices, req_ids, block_table) -> SparsePlan:
    """aiter's metadata for :func:`sparse_mla` (host work: reads req_ids; call before timing)."""
    tokens = topk_indices.shape[0]
    dev = kv_cache.device
    one_each = tokens == 0 or int(torch.bincount(req_ids.cpu().long()).max()) == 1
    return SparsePlan(
        kv_cache_ptr=kv_cache.data_ptr(),
        slots=sparse_slots(topk_indices, req_ids, block_table, kv_cache.shape[1]),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        seqused_k=torch.tensor([kv_cache.shape[0] * kv_cache.shape[1]], dtype=torch.int32, device=dev),
        max_seqlen_q=1 if one_each else tokens,
        max_seqlen_k=kv_cache.shape[0] * kv_cache.shape[1],
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, softmax_scale, *, plan=None):
    """aiter's ``unified_attention_sparse_mla`` on mlagraph's ``sparse_mla`` inputs (layout "bf16").

    Args: q_nope [T, H, L], q_pe [T, H, R] (rotated), kv_cache [num_pages, page_size, L + R],
    topk_indices [T, K] int32 key POSITIONS within each token's request (-1 = none), req_ids [T]
    int32, block_table [B, P] int32, softmax_scale. ``plan``: from :func:`prepare_sparse` (the
    position -> global slot conversion happens there, outside timing); without it, it is built
    here.

    Returns:
        out [T, H, L] in q's dtype (new tensor). No lse. A token with no valid key gets NaN
        (aiter's normalizer is 0 then), where mlagraph's op returns 0.

    Requirements (checked here, else ValueError): H a multiple of 16 (the kernel launches
    T * (H // 16) programs and silently skips the rest), page_size a power of two >= 16 (it
    is the kernel's key tile), L and R powers of two.

    aiter's contract: ``unified_attention_sparse_mla(q [T, H, L+R], kv [num_blocks,
    block_size, 1, L+R], out [T, H, L] (caller-allocated, written), cu_seqlens_q [S+1],
    max_seqlen_q, seqused_k [S], max_seqlen_k, softmax_scale, topk_indices [T, K],
    block_table [S, P], kv_lora_rank)``. topk_indices hold GLOBAL cache slots (page * block_size
    + offset), not positions: the kernel never reads block_table (nor seqused_k /
    max_seqlen_k); -1 entries are skipped. One program per (token, 16 heads), no split-K: it
    walks the K indices in tiles of block_size, scores q·[k_nope | k_pe] with two tl.dot,
    online softmax, p·v. cu_seqlens_q only locates each token's sequence (used for masking and
    the unused block-table row), so all tokens are passed as one sequence; max_seqlen_q == 1
    switches its loads to ".cg" cache hints (ALL_DECODE). aiter's note: "This kernel is not
    optimized"; num_warps 4, num_stages 1 are fixed in its host wrapper.
    """
    tokens, heads, lat = q_nope.shape
    page_size = kv_cache.shape[1]
    if heads % 16:
        raise ValueError(f"aiter sparse_mla: num heads must be a multiple of 16, got {heads}")
    if not (_pow2(page_size) and page_size >= 16):
        raise ValueError(f"aiter sparse_mla: page_size must be a power of two >= 16, got {page_size}")
    if not (_pow2(lat) and _pow2(q_pe.shape[-1])):
        raise ValueError(f"aiter sparse_mla: L and R must be powers of two, got {lat}, {q_pe.shape[-1]}")
    if plan is None:
        plan = prepare_sparse(kv_cache, topk_indices, req_ids, block_table)
    if plan.kv_cache_ptr != kv_cache.data_ptr():
        raise ValueError("aiter sparse_mla: the plan was prepared for another kv_cache")
    sparse = _load("unified_attention_sparse_mla")
    out = torch.empty((tokens, heads, lat), dtype=q_nope.dtype, device=q_nope.device)
    sparse.unified_attention_sparse_mla(
        _joined_q(q_nope, q_pe), kv_cache.unsqueeze(2), out, plan.cu_seqlens_q, plan.max_seqlen_q,
        plan.seqused_k, plan.max_seqlen_k, float(softmax_scale), plan.slots, block_table, lat,
    )
    return out


def check_sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, softmax_scale) -> float:
    """Max error of :func:`sparse_mla` against ``torch.ops.mlagraph.sparse_mla`` (float32 on CPU),
    over tokens with at least one valid key (aiter returns NaN for the others)."""
    plan = prepare_sparse(kv_cache, topk_indices, req_ids, block_table)
    out = sparse_mla(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, softmax_scale, plan=plan)
    ref, _ = torch.ops.mlagraph.sparse_mla(
        q_nope.float().cpu(), q_pe.float().cpu(), kv_cache.float().cpu(), topk_indices.cpu(), req_ids.cpu(),
        block_table.cpu(), None, "bf16", float(softmax_scale),
    )
    keep = (plan.slots.cpu() >= 0).any(dim=1)
    return _rel_err(out.cpu()[keep], ref[keep])


# ---------------------------------------------------------------------------------------------
# DSA indexer: logits (fp8_mqa_logits over packed keys, or the paged decode kernel) and top-k

BLOCK_KV = 128  # fp8_mqa_logits' key tile


@dataclasses.dataclass
class IndexerPlan:
    """aiter's fp8 inputs for the packed-keys path (:func:`prepare_indexer`)."""

    q_fp8: torch.Tensor  # [T, Hi, D] float8_e4m3fn, q / q_scale per (token, head)
    weights: torch.Tensor  # [T, Hi] float32, weights * q_scale
    kv_fp8: torch.Tensor  # [N, D] float8_e4m3fn, every request's keys, each request 128-aligned
    kv_scales: torch.Tensor  # [N] float32
    cu_starts: torch.Tensor  # [T] int32, first packed row of the token's request
    cu_ends: torch.Tensor  # [T] int32, cu_starts + positions + 1 (causal)


@dataclasses.dataclass
class PagedIndexerPlan:
    """aiter's inputs for the paged path (:func:`prepare_indexer_paged`); one row per token."""

    q_fp8: torch.Tensor  # [T, 1, Hi, D] float8_e4m3fn
    weights: torch.Tensor  # [T, Hi] float32, weights * q_scale
    kv_fp8: torch.Tensor  # [slots, D] float8_e4m3fn view of the cache rows (no copy)
    kv_scales: torch.Tensor  # [slots, 1] float32 view of the rows' scale bytes (no copy)
    context_lens: torch.Tensor  # [T] int32, positions + 1
    kv_indices: torch.Tensor  # [T, max_len] int32 flat slot of each position of the token's request
    max_model_len: int  # logits width: max_len + 1 rounded up to chunk_k (the kernel's stores)
    chunk_k: int
    split_kv: int
    cu_starts: torch.Tensor  # [T] zeros: the logits column IS the position
    cu_ends: torch.Tensor  # [T] int32, positions + 1
    beyond: torch.Tensor  # [T, max_model_len] bool: column >= context_lens[t] (set to -inf after the kernel)


def _quantize_q(q, weights):
    """q -> (e4m3 q / s, weights * s) with s = amax / 448 per (token, head), as DeepSeek V3.2
    feeds its fp8 indexer; exact for the ranking math since relu(s·x) = s·relu(x) for s > 0."""
    q_scale = (q.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-10)  # [T, Hi, 1]
    q_fp8 = (q.float() / q_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q_fp8, (weights.float() * q_scale[..., 0]).contiguous()


def _check_indexer_layout(layout):
    if layout != "fp8":
        raise ValueError(f"aiter indexer: layout must be 'fp8' (aiter's logits kernels read e4m3 keys with "
                         f"a float32 scale), got {layout!r}")


def _request_slots(table_row, n, page_size):
    """Flat cache slots of positions 0..n-1 of one request (CPU), and which are on a real page."""
    p = torch.arange(n)
    page = table_row[(p // page_size).clamp(max=table_row.shape[0] - 1)]
    ok = (page >= 0) & (p < table_row.shape[0] * page_size)
    return torch.where(ok, page * page_size + p % page_size, 0), ok


def prepare_indexer(q, weights, k_cache, req_ids, positions, block_table, layout="fp8") -> IndexerPlan:
    """mlagraph's indexer inputs -> ``fp8_mqa_logits``'s (host work and gathers; before timing).

    - q is quantized per (token, head) and the scale folded into the weights (:func:`_quantize_q`).
      So aiter scores an fp8-rounded q, while mlagraph's op scores q as given: logits differ
      at the fp8 rounding level (~1e-2).
    - fp8_mqa_logits reads keys from one contiguous [N, D] fp8 tensor plus [N] float32 scales,
      each token's visible keys being a window [cu_starts, cu_ends). So each request's keys
      (positions 0..its largest position used) are gathered from the paged cache and packed,
      each request starting at a multiple of 128: fp8_mqa_logits is only correct for
      128-aligned window starts (see :func:`indexer_logits`). Keys on page -1 are packed as
      zeros with scale 0: aiter scores them 0 instead of excluding them.

    Only layout "fp8" maps (D e4m3 bytes + a float32 scale per key, aiter's own row layout).
    """
    _check_indexer_layout(layout)
    dev = q.device
    head_dim = q.shape[-1]
    q_fp8, w = _quantize_q(q, weights)
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    req, pos = req_ids.cpu().long(), positions.cpu().long()
    table = block_table.cpu().long()
    offsets, kv, scales, start = {}, [], [], 0
    for b in sorted(set(req.tolist())):
        n = int(pos[req == b].max()) + 1
        slot, ok = _request_slots(table[b], n, k_cache.shape[1])
        got, ok = rows[slot.to(dev)], ok.to(dev)
        vals = torch.where(ok[:, None], got[:, :head_dim], 0).contiguous().view(torch.float8_e4m3fn)
        sc = torch.where(ok, got[:, head_dim:].contiguous().view(torch.float32)[:, 0], 0.0)
        pad = -n % BLOCK_KV
        kv += [vals, torch.zeros(pad, head_dim, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)]
        scales += [sc, torch.zeros(pad, dtype=torch.float32, device=dev)]
        offsets[b] = start
        start += n + pad
    starts = torch.tensor([offsets[b] for b in req.tolist()], dtype=torch.int32)
    return IndexerPlan(
        q_fp8=q_fp8,
        weights=w,
        kv_fp8=torch.cat(kv) if kv else torch.empty(0, head_dim, dtype=torch.float8_e4m3fn, device=dev),
        kv_scales=torch.cat(scales) if scales else torch.empty(0, device=dev),
        cu_starts=starts.to(dev),
        cu_ends=(starts + pos.to(torch.int32) + 1).to(dev),
    )


def prepare_indexer_paged(q, weights, k_cache, req_ids, positions, block_table, layout="fp8", chunk_k=64,
                          split_kv=5) -> PagedIndexerPlan:
    """mlagraph's indexer inputs -> aiter's paged decode logits kernel's (host work; before timing).

    The kernel reads the paged cache in place: our "fp8" indexer rows (D e4m3 | float32 scale)
    are exactly its rows, viewed as [slots, D] fp8 and [slots, 1] float32 without a copy. Each
    token is one row of its batch (next_n = 1): context_lens = positions + 1 and kv_indices
    lists the flat slot of each position 0..max_len-1 of the token's request (page size 1 view;
    positions on page -1 read slot 0: aiter scores that key, mlagraph's op never picks it).
    q is quantized as in :func:`prepare_indexer`. chunk_k (keys per step) and split_kv
    (programs per row) are the kernel's knobs (aiter's defaults 64 and 5). ``beyond`` marks
    each row's columns >= context_len, which :func:`indexer_logits` sets to -inf after the
    kernel (built here once, like the rest of the metadata).
    """
    _check_indexer_layout(layout)
    dev = q.device
    head_dim = q.shape[-1]
    q_fp8, w = _quantize_q(q, weights)
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    req, pos = req_ids.cpu().long(), positions.cpu().long()
    table = block_table.cpu().long()
    max_len = int(pos.max()) + 1 if len(pos) else 1
    per_req = {b: _request_slots(table[b], max_len, k_cache.shape[1])[0] for b in set(req.tolist())}
    idx = torch.stack([per_req[b] for b in req.tolist()]) if len(req) else torch.zeros(0, max_len, dtype=torch.long)
    # The kernel multiplies a loaded index by the row stride in the index's dtype.
    idx_dtype = torch.int32 if rows.shape[0] * rows.shape[1] < 2**31 else torch.int64
    ends = (pos + 1).to(torch.int32).to(dev)
    width = -(-(max_len + 1) // chunk_k) * chunk_k
    return PagedIndexerPlan(
        q_fp8=q_fp8[:, None],
        weights=w,
        kv_fp8=rows[:, :head_dim].view(torch.float8_e4m3fn),
        kv_scales=rows[:, head_dim:].view(torch.float32),
        context_lens=ends,
        kv_indices=idx.to(device=dev, dtype=idx_dtype).contiguous(),
        max_model_len=width,
        chunk_k=chunk_k,
        split_kv=split_kv,
        cu_starts=torch.zeros_like(ends),
        cu_ends=ends,
        beyond=torch.arange(width, device=dev)[None, :] >= ends[:, None],
    )


def indexer_logits(plan) -> torch.Tensor:
    """The indexer logits by aiter's kernel for the plan: [T, N] float32, -inf outside each
    token's window [cu_starts, cu_ends) (visible positions 0..positions[t]).

    logits[t, s] = sum_h weights[t, h] * relu(scale[s] * (q_fp8[t, h] · k_fp8[s])); mlagraph's
    ``indexer_topk`` ranks by the same sum with the unquantized q (see prepare_indexer).

    IndexerPlan -> ``fp8_mqa_logits(Q [T, Hi, D] fp8, KV [N, D] fp8, kv_scales [N] f32,
    weights [T, Hi] f32, cu_starts [T] i32, cu_ends [T] i32) -> logits [T, N] f32``, one
    program per query row (Hi and D powers of two; BLOCK_KV 128, num_warps 4, num_stages 2); N
    is every request's keys, so the output is T x (all keys). Its key loop runs from
    cu_starts[t] to the 128-aligned floor of cu_ends[t] in steps of 128 but the masked tail
    restarts at that aligned floor: with an unaligned start, columns past cu_ends get written
    and keys/logits past N can be read/written (out of bounds). Starts are 128-aligned here,
    which makes it exact. The kernel is launched directly with its host wrapper's arguments:
    that wrapper also passes the AMD-only launch options waves_per_eu / matrix_instr_nonkdim,
    which NVIDIA Triton rejects ("Keyword argument ... unrecognised"; the interpreter ignores
    them).

    PagedIndexerPlan -> ``_triton_kernels.pa_mqa_logits._deepgemm_fp8_paged_mqa_logits``
    (what ``pa_mqa_logits.deepgemm_fp8_paged_mqa_logits`` launches; that host module does
    ``from aiter import dtypes``, whose fp8 dtype is chosen by probing the AMD GPU, so it is
    not importable or usable off ROCm; the kernel module is). Grid T * next_n * split_kv, all
    heads in one program (ChunkQ = Hi), ChunkK keys per step; q [B, next_n, Hi, D] fp8, keys
    gathered through kv_indices [B, max_blk_len] (page size 1), weights [B * next_n, Hi],
    out [B * next_n, max_model_len] f32 which the CALLER must fill with -inf. Program
    (row, split) covers chunks [split * c, (split + 1) * c) of the row, c = cdiv(cdiv(context_len,
    ChunkK), SplitKV), its loop bounded by context_len (not by max_blk_len), so together the
    splits store every column < context_len; each step stores a whole ChunkK tile unmasked, so
    columns up to context_len rounded up to ChunkK are written too, and the rest is left as it
    was. Its causal mask is ``column <= context_len - pid_next_n``: column context_len (one past
    the last key) gets 0 instead of -inf whenever context_len % ChunkK != 0 (and for next_n > 1
    the per-query windows look reversed). Rather than rely on which tile columns past
    context_len each split stores and how the mask treats them, this wrapper sets EVERY column
    >= context_len of each row to -inf after the kernel (one masked_fill on the plan's
    precomputed ``beyond`` mask, part of the timed call), so the result is exact by contract:
    the kernel's values for columns < context_len, -inf for the others.
    """
    if isinstance(plan, PagedIndexerPlan):
        return _paged_logits(plan)
    kernels = _load("_triton_kernels.fp8_mqa_logits")
    tokens, heads, head_dim = plan.q_fp8.shape
    if not (_pow2(heads) and _pow2(head_dim)):
        raise ValueError(f"aiter fp8_mqa_logits: heads and head_dim must be powers of two, got {heads}, {head_dim}")
    seq_len_kv = plan.kv_fp8.shape[0]
    logits = torch.full((tokens, seq_len_kv), float("-inf"), dtype=torch.float32, device=plan.q_fp8.device)
    amd = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16} if torch.version.hip else {}
    kernels._fp8_mqa_logits_kernel[(tokens,)](
        Q_ptr=plan.q_fp8, KV_ptr=plan.kv_fp8, kv_scales_ptr=plan.kv_scales, weights_ptr=plan.weights,
        cu_start_ptr=plan.cu_starts, cu_end_ptr=plan.cu_ends, logits_ptr=logits,
        seq_len=tokens, seq_len_kv=seq_len_kv, NUM_HEADS=heads, HEAD_SIZE=head_dim,
        stride_q_s=plan.q_fp8.stride(0), stride_q_h=plan.q_fp8.stride(1), stride_q_d=plan.q_fp8.stride(2),
        stride_kv_s=plan.kv_fp8.stride(0), stride_kv_d=plan.kv_fp8.stride(1),
        stride_w_s=plan.weights.stride(0), stride_w_h=plan.weights.stride(1),
        stride_logits_s=logits.stride(0), stride_logits_k=logits.stride(1),
        BLOCK_KV=BLOCK_KV, num_warps=4, num_stages=2, **amd,
    )
    return logits


def _paged_logits(plan: PagedIndexerPlan) -> torch.Tensor:
    kernels = _load("_triton_kernels.pa_mqa_logits")
    batch, next_n, heads, head_dim = plan.q_fp8.shape
    if not (_pow2(heads) and heads >= 16 and _pow2(head_dim)):
        raise ValueError(f"aiter paged mqa logits: heads (>= 16) and head_dim must be powers of two, got "
                         f"{heads}, {head_dim}")
    logits = torch.full((batch * next_n, plan.max_model_len), float("-inf"), dtype=torch.float32,
                        device=plan.q_fp8.device)
    kernels._deepgemm_fp8_paged_mqa_logits[(batch * next_n * plan.split_kv,)](
        batch, next_n, heads, plan.q_fp8, plan.q_fp8.stride(0), plan.q_fp8.stride(1), plan.q_fp8.stride(2),
        plan.kv_fp8, plan.kv_fp8.stride(0), plan.kv_scales, plan.kv_scales.stride(0), plan.context_lens,
        plan.kv_indices, plan.weights, plan.weights.stride(0), logits, logits.stride(0), plan.max_model_len,
        plan.kv_indices.shape[1], ChunkQ=heads, ChunkK=plan.chunk_k, HiddenDim=head_dim, SplitKV=plan.split_kv,
    )
    # Columns >= context_len are not keys, whatever the kernel's tile stores left there (its
    # off-by-one puts 0 in column context_len; see indexer_logits).
    return logits.masked_fill_(plan.beyond, float("-inf"))


def indexer_topk(plan, topk: int, aiter_topk: bool = True) -> torch.Tensor:
    """aiter's logits + aiter's ``topk`` -> mlagraph's ``indexer_topk`` output [T, topk] int32
    positions (descending score, -1 past the visible keys). ``aiter_topk=False`` selects with
    torch.topk instead (aiter's DSA on ROCm selects with a HIP kernel, not this Triton topk,
    so timing the logits with a neutral top-k can be the fairer peer).

    aiter's contract: ``topk.topk(x [B, M], k) -> (values [B, k], indices [B, k] int64)``,
    sorted descending, largest only; a one-stage kernel (K unrolled argmax passes) for
    M <= 1024 -- it raises for k > 1024 there, so such calls are forced to the two-stage
    kernel (chunk-local top-k, then ONE program bitonic-sorting chunk_num * k values: with the
    packed plan M is all requests' keys, so keep that path to small batches). It fills masked
    lanes and picked entries with float32's lowest finite value, which sorts ABOVE -inf: when a
    row has fewer than k finite values, the extra picks have that value and a duplicate or
    out-of-range index. Those picks become -1 here (a real logit is never that low).

    The two-stage kernel is wrong on -inf input: a chunk whose values are all -inf hands one
    -inf to stage 2, whose bitonic compare-and-swap takes each pair apart by multiplying with
    0/1 masks (-inf * 0 = NaN) and swaps by xor-ing the bits of those sums, so values turn
    into garbage and indices part from their values (in the interpreter a row with 18 finite
    values and k = 8 comes back with 7; the garbage differs on the GPU, whose NaN bits differ).
    A row whose visible window ends a whole chunk before the row's end has such a chunk
    (chunks: 256 columns for rows < 1024, else 1024, or k rounded up to a power of two when
    larger: 2048 for the DSA's k = 2048). So -inf is clamped to that lowest finite value first (its own
    fill value, which sorts the same and stays finite; one elementwise pass, counted in the
    time): exact again.
    """
    logits = indexer_logits(plan)
    if aiter_topk:
        tk = _load("topk")
        finite = logits.clamp_min(torch.finfo(torch.float32).min)
        values, idx = tk.topk(finite, topk, tiny_row_thresh=0 if topk > 1024 else tk.MAX_TINY_ROW)
    else:  # -inf columns pad rows shorter than topk, as mlagraph's reference does
        values, idx = torch.cat([logits, logits.new_full((logits.shape[0], topk), float("-inf"))], 1).topk(topk)
    pos = idx - plan.cu_starts[:, None].long()
    valid = (values > torch.finfo(torch.float32).min) & (pos >= 0) & (pos < (plan.cu_ends - plan.cu_starts)[:, None])
    return torch.where(valid, pos, -1).to(torch.int32)


def _first(values: torch.Tensor, bad: torch.Tensor, offset: int = 0, n: int = 4) -> str:
    """'columns [c, ...] hold [v, ...]': the first n columns where ``bad`` is set (1-D, CPU)."""
    cols = bad.nonzero()[:n, 0]
    return f"columns {(cols + offset).tolist()} hold {[f'{v:.3g}' for v in values[cols].tolist()]}"


def check_indexer_logits(q, weights, k_cache, req_ids, positions, block_table, topk=None, paged=False,
                         aiter_topk=True, *, why: list | None = None) -> float:
    """Max error of aiter's indexer against mlagraph's (layout "fp8", float32 on CPU).

    ``paged``: the paged decode kernel (:func:`prepare_indexer_paged`) instead of
    fp8_mqa_logits over packed keys. Logits: aiter's against the float32 scores mlagraph's
    ``indexer_topk`` ranks by (keys dequantized by :mod:`mlagraph.ops.layouts`, unquantized
    q), over every visible key, scaled by the token's largest |score|; the -inf pattern must
    match exactly. With ``topk``: :func:`indexer_topk` against ``torch.ops.mlagraph.indexer_topk``,
    compared as the sorted reference scores of the picked keys with the same scaling (so
    ties and fp8-rounding swaps of near-equal keys count only by their score difference), and
    the number of picks per token. Expect ~1e-2 from the fp8 q. Block tables must have no
    page -1 below a token's position (aiter scores such keys).

    Returns inf when, for some token, a logit outside its visible window is not -inf, a
    visible logit is not finite, or (with ``topk``) aiter picks another number of keys than
    the reference or a key twice. ``why``: a list that gets one line per such token (stage,
    token, request, position, the condition, the first offending columns and their values);
    the top-k stage is skipped when the logits already failed.
    """
    def say(line: str) -> None:
        if why is not None:
            why.append(line)

    prepare = prepare_indexer_paged if paged else prepare_indexer
    plan = prepare(q, weights, k_cache, req_ids, positions, block_table)
    logits = indexer_logits(plan).cpu()
    qc, wc, kc = q.float().cpu(), weights.float().cpu(), k_cache.cpu()
    req, pos, table = req_ids.cpu().long(), positions.cpu().long(), block_table.cpu().long()
    rows = kc.reshape(-1, kc.shape[-1])
    ref_scores, err, failed = [], 0.0, False
    for t in range(qc.shape[0]):
        slots, _ = _request_slots(table[req[t]], int(pos[t]) + 1, kc.shape[1])
        keys = layouts.dequantize_index_keys("fp8", rows[slots], torch.float32)
        ref = (torch.relu(qc[t] @ keys.T) * wc[t][:, None]).sum(0)  # [pos + 1]
        ref_scores.append(ref)
        start, row = int(plan.cu_starts[t]), logits[t]
        end = start + len(ref)
        got = row[start:end]
        outside = ~torch.isneginf(row)
        outside[start:end] = False
        inside = ~torch.isfinite(got)
        what = (f"logits, token {t} (request {int(req[t])}, position {int(pos[t])}, window [{start}, {end}) of "
                f"{row.numel()} columns)")
        if outside.any():
            say(f"{what}: {int(outside.sum())} column(s) outside the window not -inf: {_first(row, outside)}")
        if inside.any():
            say(f"{what}: {int(inside.sum())} visible column(s) not finite: {_first(got, inside, start)}")
        if outside.any() or inside.any():
            failed = True
            continue
        err = max(err, _rel_err(got, ref))
    if failed:
        return float("inf")
    if topk is None:
        return err
    picked = indexer_topk(plan, topk, aiter_topk).cpu()
    want = torch.ops.mlagraph.indexer_topk(qc, wc, kc, req_ids.cpu(), positions.cpu(), block_table.cpu(), "fp8",
                                           topk)
    for t, ref in enumerate(ref_scores):
        a, b = picked[t][picked[t] >= 0].long(), want[t][want[t] >= 0].long()
        what = f"top-k {topk}, token {t} (request {int(req[t])}, position {int(pos[t])}, {len(ref)} visible keys)"
        if len(a) != len(b):
            say(f"{what}: aiter picks {len(a)} keys, the reference {len(b)}")
            failed = True
        elif a.unique().numel() != len(a):
            values, counts = a.unique(return_counts=True)
            say(f"{what}: {len(a) - len(values)} of aiter's picks repeat a key, first repeated positions "
                f"{values[counts > 1][:4].tolist()}")
            failed = True
        elif len(a):  # scaled like the logits: by the token's largest |score|
            diff = (ref[a].sort().values - ref[b].sort().values).abs().max()
            err = max(err, float(diff / ref.abs().max().clamp_min(1e-30)))
    return float("inf") if failed else err


# ---------------------------------------------------------------------------------------------
# runners: a prepared peer as a zero-argument callable (benchmarks/kernels.py times these)


def decode_runner(q_nope, q_pe, kv_cache, block_table, seq_lens, softmax_scale, config=None):
    """fn() -> (out [B, 1, H, L],) by :func:`mla_decode` with everything prepared.

    q is concatenated once here, outside the timing, and passed as adjacent views: in aiter's
    pipeline the fused RoPE op already produces q = cat(q_nope, q_pe), so its decode never
    pays for a concat.
    """
    lat = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)
    qn, qp = q[..., :lat], q[..., lat:]
    plan = prepare_decode(qn, kv_cache, block_table, seq_lens, config)
    return lambda: (mla_decode(qn, qp, kv_cache, block_table, seq_lens, softmax_scale, plan=plan),)


def fused_runner(sets):
    """(fn, [fn per set]) for CUDA-graph timing; fn() -> (q, k_rot, kv_cache) of sets[0].

    ``sets``: dicts of ``fused_rope_concat_cache_write``'s arguments (layout "bf16", scale
    None). k_rot is aiter's k_pe_out, valid for tokens whose slot is >= 0 (others are
    uninitialized memory); kv_cache is the set's cache, written in place.
    """
    fused = _load("fused_kv_cache")
    tables = {}

    def call(s):
        key = id(s["cos_sin_cache"])
        if key not in tables:
            tables[key] = prepare_fused_rope_cache(s["cos_sin_cache"])
        cos, sin = tables[key]
        if s.get("layout", "bf16") != "bf16" or s.get("scale") is not None:
            raise ValueError("aiter fused_runner: layout 'bf16' without a scale only")
        q, _, k, cache = fused.fused_qk_rope_cat_and_cache_mla(
            s["q_nope"], s["q_pe"], s["kv_c"].unsqueeze(1), s["k_pe"], _flat_cache(s["kv_cache"]),
            s["slot_mapping"], s["positions"], cos, sin, None, not s["interleaved"])
        return q, k, s["kv_cache"]

    for s in sets:  # prepare the tables now, outside the timing
        call(s)
    return (lambda: call(sets[0])), [lambda s=s: call(s) for s in sets]


def sparse_runner(q_nope, q_pe, kv_cache, topk_indices, req_ids, block_table, softmax_scale):
    """fn() -> (out [T, H, L],) by :func:`sparse_mla`, slots prepared and q concatenated once
    (aiter's sparse MLA reads q = cat(q_nope, q_pe) as its fused RoPE op writes it)."""
    lat = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)
    qn, qp = q[..., :lat], q[..., lat:]
    plan = prepare_sparse(kv_cache, topk_indices, req_ids, block_table)
    return lambda: (sparse_mla(qn, qp, kv_cache, topk_indices, req_ids, block_table, softmax_scale, plan=plan),)


def indexer_runner(q, weights, k_cache, req_ids, positions, block_table, layout, topk, paged=True,
                   aiter_topk=True):
    """fn() -> [T, topk] int32 positions by :func:`indexer_topk` (aiter logits + aiter topk).

    paged (default): the paged decode kernel reading the cache in place; else fp8_mqa_logits
    over keys packed once here (its logits are T x all requests' keys: small batches only).
    aiter_topk=False: torch.topk selects (see indexer_topk). q quantization and metadata are
    prepared here, outside the timing.
    """
    prepare = prepare_indexer_paged if paged else prepare_indexer
    plan = prepare(q, weights, k_cache, req_ids, positions, block_table, layout)
    return lambda: indexer_topk(plan, topk, aiter_topk)
