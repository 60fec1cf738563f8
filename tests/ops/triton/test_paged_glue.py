"""The Triton forms of the library backends' paged-batch glue (mlagraph/ops/triton/paged.py)
equal the torch forms in mlagraph/ops/_paged.py, which the flash backend tests pin."""

from __future__ import annotations

import pytest
import torch

from mlagraph.ops import _paged
from mlagraph.ops.triton import paged
from tests.helpers import make_block_table


@pytest.mark.parametrize("k,multiple", [(5, 64), (64, 64), (130, 128), (0, 64)])
@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_flat_slots_padded_equals_the_torch_ops(device, k, multiple, page_size):
    g = torch.Generator().manual_seed(k + page_size)
    seq_lens = [37, 0, 200, 9]
    table = make_block_table(seq_lens, page_size, sum(-(-n // page_size) for n in seq_lens) + 2, pad_pages=2)
    rows = torch.tensor([0, 2, 1, 3, 2, 0], dtype=torch.int32)
    width = table.shape[1] * page_size
    # in range, past the table, negative, on -1 pages; one token with only -1s
    pos = torch.randint(-3, width + 5, (len(rows), k), generator=g)
    if k:
        pos[3] = -1
    want = _paged.pad_last(_paged.flat_slots(table, pos, rows, page_size), multiple)
    got, empty = paged.flat_slots_padded(table.to(device), pos.to(device), rows.to(device), page_size, multiple)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    assert torch.equal(empty.cpu(), (want < 0).all(1))
    # the strided positions a caller may pass (a column slice) read the same
    if k:
        wide = torch.full((len(rows), 2 * k), 7)
        wide[:, ::2] = pos
        got2, _ = paged.flat_slots_padded(table.to(device), wide[:, ::2].to(device), rows.to(device), page_size,
                                          multiple)
        assert torch.equal(got2.cpu(), want)


def _torch_mask_empty(out, lse, empty):
    """The CPU path of _paged.mask_empty (the torch ops)."""
    return _paged.mask_empty(out.cpu().clone(), lse.cpu().clone(), empty.cpu())


@pytest.mark.parametrize("out_shape,lse_shape,transposed", [
    ((6, 3, 40), (6, 3), False),  # sparse: out [T, H, L], lse [T, H]
    ((5, 2, 3, 512), (5, 3, 2), True),  # FlashMLA decode: lse [B, H, s_q] read as [B, s_q, H]
    ((4, 1, 16, 512), (4, 1, 16), False),  # FlashInfer decode
    ((4, 1), (4,), False),
])
def test_mask_empty_equals_the_torch_ops_and_writes_only_the_empty_rows(device, out_shape, lse_shape, transposed):
    g = torch.Generator().manual_seed(len(out_shape))
    out = torch.randn(out_shape, generator=g).to(device)
    lse = torch.randn(lse_shape, generator=g)
    lse.view(-1)[::3] = float("inf")  # FlashMLA's keyless queries
    lse.view(-1)[1] = float("nan")  # passes through untouched
    lse = lse.to(device)
    if transposed:
        lse = lse.transpose(1, 2)
    empty = torch.tensor([i % 2 == 1 for i in range(out_shape[0])], device=device)
    before = out.clone()
    want_out, want_lse = _torch_mask_empty(out, lse, empty)
    got_out, got_lse = paged.mask_empty(out, lse, empty)
    assert got_out.data_ptr() == out.data_ptr()  # in place
    torch.testing.assert_close(got_out.cpu(), want_out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[0].cpu(), before[0].cpu())  # a row with keys is not rewritten
    assert torch.isinf(got_lse[1]).all() and not torch.isposinf(got_lse).any()


def test_mask_empty_declines_rows_it_cannot_write_in_place(device):
    out = torch.randn(4, 80).to(device)[:, ::2]
    lse = torch.randn(4, 3).to(device)
    before_out, before_lse = out.clone(), lse.clone()
    assert paged.mask_empty(out, lse, torch.ones(4, dtype=torch.bool, device=device)) is None
    assert torch.equal(out, before_out) and torch.equal(lse, before_lse)  # the caller's torch form runs
