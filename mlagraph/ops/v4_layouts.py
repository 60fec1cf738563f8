"""DeepSeek-V4 cache layouts: the sliding-window KV cache, the compressor state, compressed entries.

All three are paged with the engine's block table (``[B, P]`` page ids per request), so a V4
model needs no other bookkeeping than an MLA one: token ``p`` of request ``b`` lives at slot
``block_table[b, p // page_size] * page_size + p % page_size`` (:func:`token_slots`).

===================  ===============================  ========================================
cache                tensor                           row
===================  ===============================  ========================================
window (``swa``)     ``[num_pages, page_size, D]``    the token's rotated, normed K=V
                     model dtype                      (D = head_dim; RoPE on its last R dims).
                                                      Readers only look ``window`` positions
                                                      back, so pages wholly older than the
                                                      window are never read again.
compressor state     ``[num_pages, page_size, 2·C]``  float32 ``kv | gate + position_bias``
                     float32                          of the token (C = c·W: c = 2 for the
                                                      overlapping CSA / indexer compressors,
                                                      whose halves are the series Ca | Cb,
                                                      c = 1 for HCA). Read back only while
                                                      the token's window (and, with overlap,
                                                      the next one) is still open.
compressed entries   ``[num_pages, E, W]``            entry ``i`` pools the tokens
                     model dtype (float32 for the     ``i·m .. i·m+m-1`` (m = compress rate);
                     indexer keys)                    it lives on the page holding token
                                                      ``i·m``, row ``(i·m % page_size) // m``;
                                                      ``E = max(page_size // m, 1)``.
===================  ===============================  ========================================

``page_size`` and ``m`` must divide one another (both are powers of two in practice), so an
entry never straddles pages and no row is shared by two entries.
"""

from __future__ import annotations

import torch


def entries_per_page(page_size: int, compress_rate: int) -> int:
    """Rows of a compressed-entry cache page: ``max(page_size // m, 1)``."""
    return max(page_size // compress_rate, 1)


def rates_compatible(page_size: int, compress_rate: int) -> bool:
    return page_size % compress_rate == 0 or compress_rate % page_size == 0


def token_slots(block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat cache slots (int64, same shape as ``positions``) of request ``req_ids`` tokens.

    ``req_ids`` broadcasts against ``positions`` (say ``[T, 1]`` against ``[T, S]``). A
    position below 0, past the block table or on a -1 page maps to slot -1.
    """
    width = block_table.shape[1]
    pos = positions.long()
    col = torch.div(pos, page_size, rounding_mode="floor")
    inside = (pos >= 0) & (col < width)
    pages = block_table.long()[req_ids.long(), col.clamp(0, width - 1)]
    ok = inside & (pages >= 0)
    return torch.where(ok, pages * page_size + pos.remainder(page_size), torch.full_like(pages, -1))


def entry_slots(
    block_table: torch.Tensor, req_ids: torch.Tensor, entries: torch.Tensor, page_size: int, compress_rate: int
) -> torch.Tensor:
    """Flat rows of compressed entries (int64, shape of ``entries``) in a ``[num_pages, E, W]``
    cache; -1 for a negative entry, one past the block table or on a -1 page."""
    first = entries.long() * compress_rate  # the entry's first token
    token = token_slots(block_table, req_ids, torch.where(entries >= 0, first, -1), page_size)
    per_page = entries_per_page(page_size, compress_rate)
    page = torch.div(token, page_size, rounding_mode="floor")
    row = torch.div(token.remainder(page_size), compress_rate, rounding_mode="floor") if per_page > 1 else 0
    return torch.where(token >= 0, page * per_page + row, torch.full_like(token, -1))


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [N, R, W], slots [...] (-1 = none) -> (rows [..., W] float32, valid [...] bool).

    Invalid rows read as zeros: an unwritten row may hold anything, NaN included, and even a
    zero weight times NaN would poison a sum.
    """
    valid = slots >= 0
    rows = cache.flatten(0, 1)[torch.where(valid, slots, 0)].float()
    return torch.where(valid[..., None], rows, 0.0), valid
