"""Device-side views of a paged batch that library kernels (FlashMLA, FlashInfer) need and our
ops' contracts define: shared by both backends, each computed once per step (host_plan).

Our contract: request b sees the cached positions < ``seq_lens[b]`` whose page is not -1, and
a request (or query) that sees no key gets out 0 and lse -inf. The libraries take a length per
request and read its pages from the start, and give a keyless query +inf (FlashMLA) or an
undefined value. The engine never leaves a hole in a request's pages, so a request's keys are
its leading pages: :func:`effective_lens` cuts ``seq_lens`` at the first -1 page, and
:func:`mask_empty` writes our values for requests with no key. All shapes come from the
inputs' shapes: no host sync, capturable.
"""

from __future__ import annotations

import torch


def effective_lens(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """block_table [B, P] int32, seq_lens [B] int32 -> [B] int32 keys each request really has."""
    leading = (block_table >= 0).to(torch.int32).cumprod(1).sum(1)  # pages before the first -1
    return torch.minimum(seq_lens, leading * page_size).to(torch.int32)


def mask_empty(out: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [N, ..., L], lse [N, ...] float32, empty [N] bool -> out 0 and lse -inf where empty,
    and lse -inf wherever the kernel reported a keyless query as +inf (FlashMLA's convention).
    On CUDA one kernel does it all and writes only the empty rows of out
    (:func:`mlagraph.ops.triton.paged.mask_empty`)."""
    if out.is_cuda:
        done = _triton_paged().mask_empty(out, lse, empty)
        if done is not None:
            return done
    out.masked_fill_(empty.view(-1, *([1] * (out.dim() - 1))), 0.0)
    keyless = empty.view(-1, *([1] * (lse.dim() - 1))) | torch.isposinf(lse)
    return out, lse.masked_fill(keyless, float("-inf"))


def flat_slots(block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots (page * page_size + offset) of key ``positions`` [T, K] (int, -1 = none) of
    request ``rows`` [T] -> [T, K] int32, -1 where the position is < 0, past the table or on a
    -1 page (the libraries' "no key")."""
    max_len = block_table.shape[1] * page_size
    pos = positions.long()
    ok = (pos >= 0) & (pos < max_len)
    p = pos.clamp(0, max(max_len - 1, 0))
    pages = block_table.long()[rows.long()[:, None], p // page_size]
    ok = ok & (pages >= 0)
    return torch.where(ok, pages * page_size + p % page_size, -1).to(torch.int32)


def flat_slots_padded(block_table: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, page_size: int,
                      multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_last(flat_slots(...), multiple)`` [T, K'] int32 and the tokens with no key at all
    ([T] bool): one Triton kernel on CUDA, the torch ops elsewhere."""
    if positions.is_cuda:
        return _triton_paged().flat_slots_padded(block_table, positions, rows, page_size, multiple)
    idx = pad_last(flat_slots(block_table, positions, rows, page_size), multiple)
    return idx, (idx < 0).all(1)


def _triton_paged():
    from .triton import paged  # Triton is there wherever a library backend runs (CUDA)

    return paged


def pad_last(t: torch.Tensor, multiple: int, value: int = -1) -> torch.Tensor:
    """Pads the last dim of an index tensor to a multiple of ``multiple`` with ``value``."""
    k = t.shape[-1]
    extra = (-k) % multiple
    if extra == 0:
        return t
    return torch.nn.functional.pad(t, (0, extra), value=value)
