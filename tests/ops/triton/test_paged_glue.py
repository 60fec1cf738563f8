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


@pytest.mark.parametrize("shape", [(6, 3, 40), (5, 2, 3, 512), (4, 1)])
def test_zero_rows_writes_only_the_empty_rows(device, shape):
    out = torch.randn(shape).to(device)
    before = out.clone()
    empty = torch.tensor([i % 2 == 1 for i in range(shape[0])], device=device)
    assert paged.zero_rows_(out, empty)
    for i in range(shape[0]):
        assert torch.equal(out[i].cpu(), torch.zeros_like(before[i].cpu()) if i % 2 else before[i].cpu())
    if shape[-1] > 1:
        strided = torch.randn(shape[0], 2 * shape[-1]).to(device)[:, ::2]
        assert not paged.zero_rows_(strided, empty)  # the caller falls back to masked_fill_
