"""Latent cache ops: write new tokens, read a request's prefix back, and the fused
RoPE → concat → cache write that a backend may replace with one kernel.

L (kv_lora_rank) and R (rope dim) are read from tensor shapes. The layout is always passed by
name and every byte goes through :mod:`.layouts` (docs/design.md rule 5: a reader never guesses
the layout from a row width, so a 576-wide cache passed as "fp8_ds" is an error, not a misread).
"""

import torch

from . import layouts
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_positive, check_same_dtype, check_tensor, fail
from ._define import custom_op
from .rope import _check_rope, rope_reference


def _cache_dtypes(layout: str) -> tuple[torch.dtype, ...]:
    # "bf16" is DeepSeek's name for "unquantized": the cache holds the model dtype.
    return FLOAT_DTYPES if layout == "bf16" else (layouts.latent_storage_dtype(layout, torch.float32),)


def _check_cache(op: str, kv_cache: torch.Tensor, layout: str, kv_lora_rank, rope_dim, device) -> None:
    """kv_cache [num_pages, page_size, row_width] of the layout's dtype and width."""
    check_tensor(op, "kv_cache", kv_cache, ndim=3, dtypes=_cache_dtypes(layout), device=device)
    if layout == "fp8_ds" and kv_lora_rank % layouts.DS_GROUP != 0:
        fail(
            op,
            "kv_cache",
            f"a row width L + 4·L/{layouts.DS_GROUP} + 2·R for layout 'fp8_ds' with L a multiple of "
            f"{layouts.DS_GROUP} (656 for L=512, R=64)",
            f"width {kv_cache.shape[2]} (L={kv_lora_rank}, R={rope_dim})",
        )
    width = layouts.latent_row_width(layout, kv_lora_rank, rope_dim)
    if kv_lora_rank <= 0 or kv_cache.shape[2] != width:
        fail(
            op,
            "kv_cache",
            f"row width {width} for layout {layout!r} with L={kv_lora_rank}, R={rope_dim}",
            f"shape {list(kv_cache.shape)}",
        )
    pages, page_size, _ = kv_cache.shape
    # Rows are addressed as one flat [pages * page_size, width] view.
    if pages > 1 and page_size > 1 and kv_cache.stride(0) != page_size * kv_cache.stride(1):
        fail(op, "kv_cache", "pages and slots laid out densely (stride(0) == page_size * stride(1))",
             f"strides {list(kv_cache.stride())}")


def _check_scale(op: str, scale: torch.Tensor | None, layout: str, device) -> None:
    if scale is None:
        if layout == "fp8":
            fail(op, "scale", "a [1] float32 tensor for layout 'fp8'", None)
        return
    check_tensor(op, "scale", scale, shape=(1,), dtypes=(torch.float32,), device=device)


# ---------------------------------------------------------------------------------------------
# write


def _check_latent_cache_write(
    op: str,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    device: torch.device | None = None,
) -> None:
    check_choice(op, "layout", layout, layouts.LATENT_LAYOUTS)
    check_tensor(op, "kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    t, latent = kv_c.shape
    dev = kv_c.device
    check_tensor(op, "k_pe", k_pe, shape=(t, None), device=dev)
    check_same_dtype(op, "k_pe", k_pe, "kv_c", kv_c)
    if layout == "fp8_ds" and latent % layouts.DS_GROUP != 0:
        fail(op, "kv_c", f"kv_lora_rank (last dim) a multiple of {layouts.DS_GROUP} for layout 'fp8_ds'",
             f"shape {list(kv_c.shape)}")
    _check_cache(op, kv_cache, layout, latent, k_pe.shape[1], dev)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(t,), dtypes=INDEX_DTYPES, device=dev)
    _check_scale(op, scale, layout, dev)


def _write(kv_c, k_pe, kv_cache, slot_mapping, scale, layout) -> None:
    if kv_c.shape[0] == 0:
        return  # nothing to write (scatter_rows needs at least one row)
    rows = layouts.quantize_latent(layout, kv_c, k_pe, scale, kv_cache.dtype)
    layouts.scatter_rows(kv_cache, slot_mapping, rows)


@custom_op("mlagraph::latent_cache_write", mutates_args=("kv_cache",))
def latent_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
) -> None:
    """Writes T tokens' latent and rope key into the paged cache.

    Args:
        kv_c: [T, L] float32/bf16/fp16, the compressed latent (after kv_a_layernorm).
        k_pe: [T, R], dtype of kv_c, the rope key (already rotated).
        kv_cache: [num_pages, page_size, W], written in place. "bf16": W = L + R in
            bf16/fp16/fp32; "fp8": W = L + R float8_e4m3fn; "fp8_ds": W = L + L/32 + 2R uint8.
        slot_mapping: [T] int32/int64, slot page * page_size + offset; -1 skips the token.
        scale: [1] float32 per-tensor scale, required for "fp8", ignored otherwise.
        layout: "bf16", "fp8" or "fp8_ds" (see :mod:`.layouts`).
    """
    _check_latent_cache_write("latent_cache_write", kv_c, k_pe, kv_cache, slot_mapping, scale, layout)
    _write(kv_c, k_pe, kv_cache, slot_mapping, scale, layout)


@latent_cache_write.register_fake
def latent_cache_write_fake(kv_c, k_pe, kv_cache, slot_mapping, scale, layout):
    _check_latent_cache_write("latent_cache_write", kv_c, k_pe, kv_cache, slot_mapping, scale, layout)


# ---------------------------------------------------------------------------------------------
# read


def _check_latent_cache_read(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    rope_dim: int,
    out_dtype: torch.dtype,
    num_tokens: int,
) -> int:
    """Returns L."""
    op = "latent_cache_read"
    check_choice(op, "layout", layout, layouts.LATENT_LAYOUTS)
    check_positive(op, "rope_dim", rope_dim)
    check_tensor(op, "kv_cache", kv_cache, ndim=3)
    latent = layouts.latent_kv_lora_rank(layout, kv_cache.shape[2], rope_dim)
    dev = kv_cache.device
    _check_cache(op, kv_cache, layout, latent, rope_dim, dev)
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor(op, "cu_seq_lens", cu_seq_lens, shape=(block_table.shape[0] + 1,), dtypes=(torch.int32,), device=dev)
    _check_scale(op, scale, layout, dev)
    check_choice(op, "out_dtype", out_dtype, FLOAT_DTYPES)
    if num_tokens < 0:
        fail(op, "num_tokens", "a non-negative int (= cu_seq_lens[-1])", num_tokens)
    return latent


def _read_rows(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor, num_tokens: int):
    """Cache rows [N, W] of every request's tokens 0..len-1, packed request after request."""
    num_reqs, max_pages = block_table.shape
    page_size = kv_cache.shape[1]
    n = torch.arange(num_tokens, device=kv_cache.device, dtype=cu_seq_lens.dtype)
    # Clamps only keep a caller's broken metadata from faulting on the device: it reads garbage.
    req = (torch.searchsorted(cu_seq_lens, n, right=True) - 1).clamp(0, num_reqs - 1)
    pos = n.long() - cu_seq_lens.long()[req]
    page = block_table.long()[req, (pos // page_size).clamp(0, max_pages - 1)]
    slot = torch.where(page >= 0, page * page_size + pos % page_size, torch.zeros_like(page))
    return kv_cache.flatten(0, 1)[slot]


@custom_op("mlagraph::latent_cache_read", mutates_args=())
def latent_cache_read(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    rope_dim: int,
    out_dtype: torch.dtype,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers and dequantizes the cached prefix of B requests (chunked prefill).

    Args:
        kv_cache: [num_pages, page_size, W] in ``layout`` (see :func:`latent_cache_write`).
        block_table: [B, P] int32 page ids; -1 = unused.
        cu_seq_lens: [B+1] int32; request b's tokens 0..len_b-1 land at rows
            cu_seq_lens[b]..cu_seq_lens[b+1]-1 of the outputs.
        scale: [1] float32, required for "fp8".
        layout: "bf16", "fp8" or "fp8_ds".
        rope_dim: R.
        out_dtype: float32, bf16 or fp16.
        num_tokens: N = cu_seq_lens[-1], given on the host so the output shape needs no sync.

    Returns:
        (kv_c [N, L], k_pe [N, R]) in out_dtype.
    """
    _check_latent_cache_read(kv_cache, block_table, cu_seq_lens, scale, layout, rope_dim, out_dtype, num_tokens)
    rows = _read_rows(kv_cache, block_table, cu_seq_lens, num_tokens)
    kv_c, k_pe = layouts.dequantize_latent(layout, rows, rope_dim, scale, out_dtype)
    # Dequantizing may hand back two views of one buffer; outputs must not alias.
    return kv_c.clone(memory_format=torch.contiguous_format), k_pe.clone(memory_format=torch.contiguous_format)


@latent_cache_read.register_fake
def latent_cache_read_fake(kv_cache, block_table, cu_seq_lens, scale, layout, rope_dim, out_dtype, num_tokens):
    latent = _check_latent_cache_read(
        kv_cache, block_table, cu_seq_lens, scale, layout, rope_dim, out_dtype, num_tokens
    )
    return (
        kv_cache.new_empty((num_tokens, latent), dtype=out_dtype),
        kv_cache.new_empty((num_tokens, rope_dim), dtype=out_dtype),
    )


# ---------------------------------------------------------------------------------------------
# fused RoPE -> concat -> write


def _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout):
    op = "fused_rope_concat_cache_write"
    check_tensor(op, "q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES)
    t, h, _ = q_nope.shape
    dev = q_nope.device
    check_tensor(op, "q_pe", q_pe, shape=(t, h, None), device=dev)
    check_same_dtype(op, "q_pe", q_pe, "q_nope", q_nope)
    _check_rope(op, q_pe, k_pe, positions, cos_sin_cache)
    check_tensor(op, "kv_c", kv_c, shape=(t, None), device=dev)
    check_same_dtype(op, "kv_c", kv_c, "q_nope", q_nope)
    _check_latent_cache_write(op, kv_c, k_pe[:, 0], kv_cache, slot_mapping, scale, layout, device=dev)


@custom_op("mlagraph::fused_rope_concat_cache_write", mutates_args=("kv_cache",))
def fused_rope_concat_cache_write(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None,
    layout: str,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE → concat → latent cache write, as one op a backend may fuse. Defined as::

        q_rot, k_rot = rope(q_pe, k_pe, positions, cos_sin_cache, interleaved)
        q = cat([q_nope, q_rot], -1)
        latent_cache_write(kv_c, k_rot[:, 0], kv_cache, slot_mapping, scale, layout)
        return q, k_rot

    Args:
        q_nope: [T, H, Dn] float32/bf16/fp16 (Dn = L for absorbed decode, qk_nope_head_dim
            for MHA prefill).
        q_pe: [T, H, R], dtype of q_nope.
        kv_c: [T, L], dtype of q_nope.
        k_pe: [T, 1, R], dtype of q_nope, not yet rotated.
        positions, cos_sin_cache, interleaved: as in ``rope``.
        kv_cache, slot_mapping, scale, layout: as in ``latent_cache_write``; kv_cache is
            written in place.

    Returns:
        (q [T, H, Dn + R], k_rot [T, 1, R]) in the dtype of q_nope.
    """
    _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout)
    q_rot, k_rot = rope_reference(q_pe, k_pe, positions, cos_sin_cache, interleaved)
    _write(kv_c, k_rot[:, 0], kv_cache, slot_mapping, scale, layout)
    return torch.cat([q_nope, q_rot], dim=-1), k_rot


@fused_rope_concat_cache_write.register_fake
def fused_rope_concat_cache_write_fake(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout, interleaved):
    _check_fused(q_nope, q_pe, kv_c, k_pe, positions, cos_sin_cache, kv_cache, slot_mapping, scale, layout)
    t, h, dn = q_nope.shape
    return q_nope.new_empty((t, h, dn + q_pe.shape[2])), k_pe.new_empty(k_pe.shape)
