"""Absorbed MLA decode over the paged latent cache (DeepSeek V2/V3 decode and multi-token verify).

With W_UK absorbed into the query, every head scores the cached latents directly,

    score[h, s] = softmax_scale * (q_nope[h] . kv_c[s] + q_pe[h] . k_pe[s])
    out[h]      = sum_s softmax(score[h])[s] * kv_c[s]
    lse[h]      = log(sum_s exp(score[h, s]))          (natural log, float32)

so the latent ``kv_c`` is both the key (with ``k_pe``) and the value; the caller applies W_UV to
``out``. A query that sees no key gets ``out = 0`` and ``lse = -inf``, never NaN.

The helpers below (latent cache checks, row gathering, masked latent attention) are shared with
:mod:`.sparse`, which runs the same math over the indexer's top-k keys, and :func:`masked_softmax`
with :mod:`.prefill`.
"""

from __future__ import annotations

import torch

from . import layouts
from ._checks import FLOAT_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op, dense_empty

# ---------------------------------------------------------------------------------------------
# shared by the latent attention ops (mla_decode, sparse_mla)


def check_latent_cache(
    op: str, kv_cache: torch.Tensor, scale: torch.Tensor | None, layout: str, kv_lora_rank: object,
    rope_dim: object, device: torch.device,
) -> None:
    """Checks ``layout``, the cache's row width and dtype for it, and the fp8 per-tensor scale."""
    check_choice(op, "layout", layout, layouts.LATENT_LAYOUTS)
    if layout == "fp8_ds" and kv_lora_rank % layouts.DS_GROUP != 0:
        fail(op, "q_nope", f"a last dim (kv_lora_rank) divisible by {layouts.DS_GROUP} for layout 'fp8_ds'",
             kv_lora_rank)
    width = layouts.latent_row_width(layout, kv_lora_rank, rope_dim)
    dtypes = FLOAT_DTYPES if layout == "bf16" else (layouts.latent_storage_dtype(layout, torch.float32),)
    check_tensor(op, "kv_cache", kv_cache, shape=(None, None, width), dtypes=dtypes, device=device)
    if layout == "fp8":
        if scale is None:
            fail(op, "scale", "a [1] float32 tensor for layout 'fp8'", "None")
        check_tensor(op, "scale", scale, shape=(1,), dtypes=(torch.float32,), device=device)


def gather_latent(
    kv_cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor | None, layout: str,
    rope_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [N, S] int64 flat cache slots, valid [N, S] bool -> kv_c [N, S, L], k_pe [N, S, R] float32.

    Rows that are not valid read as zeros: they may hold garbage (even NaN), and a masked key's
    zero weight times NaN would still poison the output.
    """
    rows = kv_cache.flatten(0, 1)[torch.where(valid, slots, 0)]
    kv_c, k_pe = layouts.dequantize_latent(layout, rows, rope_dim, scale, torch.float32)
    keep = valid[..., None]
    return torch.where(keep, kv_c, 0.0), torch.where(keep, k_pe, 0.0)


def masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., S] float32, visible bool (broadcastable) -> probs [..., S], lse [...].

    A row with no visible key gets probs 0 and lse -inf instead of NaN.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # (-inf) - (-inf) is NaN; shifting empty rows by 0 instead keeps them at exp(-inf) = 0.
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return probs, lse


def latent_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, visible: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA for N independent groups of M queries sharing S keys, all in float32.

    q_nope [N, M, H, L], q_pe [N, M, H, R], kv_c [N, S, L], k_pe [N, S, R], visible [N, M, S] bool
    -> out [N, M, H, L] float32, lse [N, M, H] float32 (both contiguous).
    """
    scores = torch.einsum("nmhl,nsl->nmhs", q_nope.float(), kv_c) + torch.einsum(
        "nmhr,nsr->nmhs", q_pe.float(), k_pe
    )
    probs, lse = masked_softmax(scores * softmax_scale, visible[:, :, None, :])
    out = torch.einsum("nmhs,nsl->nmhl", probs, kv_c)
    return out.contiguous(), lse.contiguous()


# ---------------------------------------------------------------------------------------------
# mla_decode


def _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale) -> None:
    op = "mla_decode"
    check_tensor(op, "q_nope", q_nope, ndim=4, dtypes=FLOAT_DTYPES)
    batch, s_q, num_heads, kv_lora_rank = q_nope.shape
    dev = q_nope.device
    check_tensor(op, "q_pe", q_pe, shape=(batch, s_q, num_heads, None), device=dev)
    check_same_dtype(op, "q_pe", q_pe, "q_nope", q_nope)
    check_latent_cache(op, kv_cache, scale, layout, kv_lora_rank, q_pe.shape[3], dev)
    check_tensor(op, "block_table", block_table, shape=(batch, None), dtypes=(torch.int32,), device=dev)
    check_tensor(op, "seq_lens", seq_lens, shape=(batch,), dtypes=(torch.int32,), device=dev)
    check_positive(op, "softmax_scale", softmax_scale)


@custom_op("mlagraph::mla_decode", mutates_args=())
def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA of s_q new tokens per request over the paged latent cache.

    Query i of request b sits at position ``seq_lens[b] - s_q + i`` and sees the keys at
    positions 0..that position: causal within the new tokens, plain decode for s_q = 1.

    Args:
        q_nope: [B, s_q, H, L] float32/bfloat16/float16, queries with W_UK absorbed.
        q_pe: [B, s_q, H, R], same dtype, the rotated rope part of the queries.
        kv_cache: [num_pages, page_size, W] latent cache in ``layout`` (see :mod:`.layouts`):
            "bf16" -> W = L + R in bf16/fp16/fp32; "fp8" -> W = L + R float8_e4m3fn;
            "fp8_ds" -> W = L + 4·L/128 + 2·R uint8 (L divisible by 128).
        block_table: [B, P] int32 page ids of each request (-1 = no page).
        seq_lens: [B] int32 tokens in the cache per request, INCLUDING the s_q new ones (already
            written). 0 marks a padding request: its out is 0 and its lse -inf.
        scale: [1] float32 per-tensor scale, required for "fp8", ignored otherwise.
        layout: "bf16", "fp8" or "fp8_ds".
        softmax_scale: > 0, multiplies q.k.

    Returns:
        out: [B, s_q, H, L] in q's dtype; lse: [B, s_q, H] float32 natural-log log-sum-exp of
        the scaled scores (-inf where a query sees no key).
    """
    _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)
    s_q = q_nope.shape[1]
    page_size = kv_cache.shape[1]
    # Every request reads the table's full width and masks: no data-dependent shapes.
    max_len = block_table.shape[1] * page_size
    slots = layouts.slots_from_block_table(block_table, page_size, max_len)  # [B, S]
    pos = torch.arange(max_len, device=q_nope.device)
    lens = seq_lens.long()[:, None]  # [B, 1]
    valid = (pos[None, :] < lens) & (slots >= 0)  # [B, S]
    kv_c, k_pe = gather_latent(kv_cache, slots, valid, scale, layout, q_pe.shape[-1])

    q_pos = lens - s_q + torch.arange(s_q, device=q_nope.device)[None, :]  # [B, s_q]
    visible = valid[:, None, :] & (pos[None, None, :] <= q_pos[:, :, None])  # [B, s_q, S]
    out, lse = latent_attention(q_nope, q_pe, kv_c, k_pe, visible, softmax_scale)
    return out.to(q_nope.dtype), lse


@mla_decode.register_fake
def mla_decode_fake(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale):
    _check_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, layout, softmax_scale)
    batch, s_q, num_heads, kv_lora_rank = q_nope.shape
    # strides written out (dense_empty): the model views out as [T, H, L] with no guard
    return (dense_empty(q_nope, (batch, s_q, num_heads, kv_lora_rank)),
            dense_empty(q_nope, (batch, s_q, num_heads), torch.float32))
