"""Cache layouts: explicit descriptors for every byte the latent and indexer caches hold.

Every writer and reader takes the layout by name (docs/design.md rule 5: a reader never infers
the layout from a row width). A cache is a tensor ``[num_pages, page_size, row_width]``; token
``t`` of a request lives at slot ``block_table[b, pos // page_size] * page_size + pos % page_size``.

Latent cache, per token (L = kv_lora_rank, R = rope dim; DeepSeek: L=512, R=64):

=========  ======================  ===========================================================
name       storage dtype           row
=========  ======================  ===========================================================
``bf16``   the model dtype         ``L + R`` values: kv_c | k_pe, unquantized. The name is
           (bf16/fp16/fp32)        DeepSeek's; float32 models keep float32 rows.
``fp8``    ``float8_e4m3fn``       ``L + R`` e4m3 values of ``x / scale`` with one per-tensor
                                   float32 ``scale`` (shape ``[1]``) passed to every op.
``fp8_ds`` ``uint8``               ``L + 4·L/128 + 2·R`` bytes: L e4m3 values | one float32
                                   scale per 128 latent values | R bf16 rope values
                                   (656 bytes for DeepSeek).
=========  ======================  ===========================================================

Indexer key cache (V3.2), per token (D = index_head_dim):

=========  ======================  ===========================================================
``bf16``   the model dtype         ``D`` values
``fp8``    ``uint8``               ``D + 4`` bytes: D e4m3 values | one float32 scale
=========  ======================  ===========================================================

The helpers below are the reference (de)quantizers; every reference op uses them, so a layout
is defined in exactly one place.
"""

from __future__ import annotations

import torch

LATENT_LAYOUTS = ("bf16", "fp8", "fp8_ds")
INDEXER_LAYOUTS = ("bf16", "fp8")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
DS_GROUP = 128  # fp8_ds: one float32 scale per this many latent values
_MIN_SCALE = 1e-10  # keeps all-zero groups finite


# ---------------------------------------------------------------------------------------------
# latent cache


def latent_row_width(layout: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Width of one cache row in elements of the cache tensor's dtype."""
    if layout in ("bf16", "fp8"):
        return kv_lora_rank + rope_dim
    if layout == "fp8_ds":
        return kv_lora_rank + 4 * (kv_lora_rank // DS_GROUP) + 2 * rope_dim
    raise ValueError(f"latent cache layout: expected one of {LATENT_LAYOUTS}, got {layout!r}")


def latent_kv_lora_rank(layout: str, row_width: int, rope_dim: int) -> int:
    """Inverse of :func:`latent_row_width` for a given rope dim."""
    if layout in ("bf16", "fp8"):
        return row_width - rope_dim
    if layout == "fp8_ds":
        # row = L + L/32 + 2R  =>  L = (row - 2R) * 32 / 33
        return (row_width - 2 * rope_dim) * 32 // 33
    raise ValueError(f"latent cache layout: expected one of {LATENT_LAYOUTS}, got {layout!r}")


def latent_storage_dtype(layout: str, model_dtype: torch.dtype) -> torch.dtype:
    return {"bf16": model_dtype, "fp8": FP8_DTYPE, "fp8_ds": torch.uint8}[layout]


def latent_layout_for(kv_cache_dtype: str) -> str:
    """Maps the user-facing ``kv_cache_dtype`` ("auto", "bf16", "fp8", "fp8_ds") to a layout."""
    table = {"auto": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds": "fp8_ds"}
    if kv_cache_dtype not in table:
        raise ValueError(f"kv_cache_dtype: expected one of {sorted(table)}, got {kv_cache_dtype!r}")
    return table[kv_cache_dtype]


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """Reinterprets the last dim of a contiguous tensor as bytes: [..., n] -> [..., n * itemsize]."""
    return x.contiguous().view(torch.uint8)


def quantize_latent(
    layout: str, kv_c: torch.Tensor, k_pe: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype
) -> torch.Tensor:
    """kv_c [N, L], k_pe [N, R] -> cache rows [N, row_width] in ``cache_dtype``."""
    if layout == "bf16":
        return torch.cat([kv_c, k_pe], dim=-1).to(cache_dtype)
    if layout == "fp8":
        x = torch.cat([kv_c, k_pe], dim=-1).float() / scale.float()
        return _fp8(x)
    # fp8_ds
    n, latent = kv_c.shape
    groups = kv_c.float().reshape(n, latent // DS_GROUP, DS_GROUP)
    group_scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)  # [N, L/128]
    q = _fp8(groups / group_scale[..., None]).reshape(n, latent)
    return torch.cat([_bytes(q), _bytes(group_scale), _bytes(k_pe.to(torch.bfloat16))], dim=-1)


def dequantize_latent(
    layout: str, rows: torch.Tensor, rope_dim: int, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cache rows [..., row_width] -> (kv_c [..., L], k_pe [..., R]) in ``out_dtype``."""
    if layout == "bf16":
        latent = rows.shape[-1] - rope_dim
        return rows[..., :latent].to(out_dtype), rows[..., latent:].to(out_dtype)
    if layout == "fp8":
        x = rows.float() * scale.float()
        latent = rows.shape[-1] - rope_dim
        return x[..., :latent].to(out_dtype), x[..., latent:].to(out_dtype)
    # fp8_ds
    latent = latent_kv_lora_rank(layout, rows.shape[-1], rope_dim)
    n_groups = latent // DS_GROUP
    lead = rows.shape[:-1]
    q = rows[..., :latent].contiguous().view(FP8_DTYPE).float()
    group_scale = rows[..., latent : latent + 4 * n_groups].contiguous().view(torch.float32)
    pe = rows[..., latent + 4 * n_groups :].contiguous().view(torch.bfloat16)
    kv_c = (q.reshape(*lead, n_groups, DS_GROUP) * group_scale[..., None]).reshape(*lead, latent)
    return kv_c.to(out_dtype), pe.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# indexer key cache


def indexer_row_width(layout: str, head_dim: int) -> int:
    if layout == "bf16":
        return head_dim
    if layout == "fp8":
        return head_dim + 4
    raise ValueError(f"indexer cache layout: expected one of {INDEXER_LAYOUTS}, got {layout!r}")


def indexer_storage_dtype(layout: str, model_dtype: torch.dtype) -> torch.dtype:
    return {"bf16": model_dtype, "fp8": torch.uint8}[layout]


def quantize_index_keys(layout: str, k: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """k [N, D] -> rows [N, row_width]."""
    if layout == "bf16":
        return k.to(cache_dtype)
    scale = (k.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)  # [N, 1]
    return torch.cat([_bytes(_fp8(k.float() / scale)), _bytes(scale)], dim=-1)


def dequantize_index_keys(layout: str, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [..., row_width] -> k [..., D]."""
    if layout == "bf16":
        return rows.to(out_dtype)
    head_dim = rows.shape[-1] - 4
    q = rows[..., :head_dim].contiguous().view(FP8_DTYPE).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (q * scale).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# paging


def slots_from_block_table(block_table: torch.Tensor, page_size: int, max_len: int) -> torch.Tensor:
    """block_table [B, P] -> slots [B, max_len] of positions 0..max_len-1 (int64).

    Positions past a request's pages read page ids the caller must mask; a -1 page id maps to
    slot -1 (never a real row).
    """
    pos = torch.arange(max_len, device=block_table.device)
    pages = block_table.long()[:, pos // page_size]  # [B, max_len]
    return torch.where(pages >= 0, pages * page_size + pos % page_size, torch.full_like(pages, -1))


def scatter_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_pages, page_size, W] <- rows [T, W] at slot_mapping [T]; slot -1 is skipped.

    No host sync and no data-dependent shapes, so it can run inside a CUDA graph: a skipped
    row is redirected to the slot (and value) of the first valid row, so duplicates write
    identical bytes; with no valid row at all, row 0 of the cache is rewritten with itself.
    """
    flat = cache.view(-1, cache.shape[-1])
    slots = slot_mapping.long()
    valid = slots >= 0
    # [1], not 0-d: indexing with a 0-d tensor reads its value on the host (a sync).
    first = torch.argmax(valid.to(torch.int32)).view(1)  # index of the first valid row (0 if none)
    any_valid = valid.any()
    idx = torch.where(valid, slots, slots.index_select(0, first))
    vals = torch.where(valid[:, None], rows, rows.index_select(0, first))
    idx = torch.where(any_valid, idx, torch.zeros_like(idx))
    vals = torch.where(any_valid, vals, flat[0][None, :].expand_as(vals))
    flat.index_put_((idx,), vals)
