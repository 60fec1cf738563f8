"""Triton ``compressor_update``: DeepSeek-V4's compressors (CSA, HCA, the CSA indexer's).

Math (see :mod:`mlagraph.ops.compressor`): each token appends a ``kv | gate + position_bias``
row to its request's paged state cache; a token that closes a window (``(p + 1) % m == 0``)
pools that window into entry ``e = p // m``:

    pooled[f] = sum_s softmax_s(gate[s, f]) · kv[s, f]        (per feature f, over the slots s)
    entry     = rope(rmsnorm(pooled) · norm_weight)           (interleaved RoPE, last R dims, at e·m)

with slots the m tokens of window e (HCA), or with overlap (CSA, indexer) the Ca halves of
window e-1's tokens and the Cb halves of window e's: 2m slots.

Two launches, because a window's slots are rows other programs of the same call may write:

- ``_state_write_kernel``, grid ``(T,)``: row t of ``kv | gate + bias[p % m]`` to slot t.
- ``_pool_kernel``, grid ``(T,)``: a program whose token closes a window walks its slots
  BLOCK_S at a time with an online softmax per feature (float32 running max, sum and weighted
  value: HCA's 128 slots of 512 features never sit in registers at once), then normalises,
  rotates and stores the entry; every other program returns at once. A slot before position
  0, past the block table or on a -1 page is masked (loads as 0 with a -inf gate), as the
  reference's ``gather_rows`` does.

The rotation pairs features (2j, 2j+1) of the pooled row: the row is reshaped to
``[BW/2, 2]`` and split, so no feature is pooled twice. That needs the rotated part to start at
an even feature (W - R even: W = 512 and 128 in DeepSeek-V4); an odd W runs the reference op.

Nothing reads tensor values on the host and both grids are fixed by T, so a call can be captured
in a CUDA graph. Math in float32 throughout (the state cache is float32); the entry is cast to
the compressed cache's dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_runnable


@triton.jit
def _state_write_kernel(
    kv, gate, bias, positions, slot_mapping, state,
    stride_kv, stride_gate, stride_bias, stride_st_page, stride_st_tok, stride_st_f,
    C: tl.constexpr, RATE: tl.constexpr, PAGE: tl.constexpr, BC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        p = tl.load(positions + t).to(tl.int64)
        offs = tl.arange(0, BC)
        ok = offs < C
        v = tl.load(kv + t * stride_kv + offs, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(gate + t * stride_gate + offs, mask=ok, other=0.0).to(tl.float32)
        g += tl.load(bias + (p % RATE) * stride_bias + offs, mask=ok, other=0.0)
        row = state + (slot // PAGE) * stride_st_page + (slot % PAGE) * stride_st_tok
        tl.store(row + offs * stride_st_f, v, mask=ok)
        tl.store(row + (C + offs) * stride_st_f, g, mask=ok)


@triton.jit
def _pool_entry(
    e, bt_row, state, norm_weight, cos_sin, dest,
    stride_bt_p, stride_st_page, stride_st_tok, stride_st_f, stride_cs, stride_c_f, NUM_COLS, eps,
    W: tl.constexpr, BW: tl.constexpr, R: tl.constexpr, RATE: tl.constexpr, PAGE: tl.constexpr,
    OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Pools, normalises and rotates entry e of the request whose block-table row is bt_row."""
    C: tl.constexpr = 2 * W if OVERLAP else W
    S: tl.constexpr = 2 * RATE if OVERLAP else RATE
    start = (e - 1) * RATE if OVERLAP else e * RATE
    offs_f = tl.arange(0, BW)
    f_ok = offs_f < W
    offs_s = tl.arange(0, BLOCK_S)
    # a finite floor, not -inf: a feature with no slot yet (or a padded lane) needs no NaN guard
    m_i = tl.full([BW], -1.0e30, tl.float32)
    l_i = tl.zeros([BW], tl.float32)
    acc = tl.zeros([BW], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + offs_s
        sp = start + s
        col = sp // PAGE
        in_run = (s < S) & (sp >= 0) & (col < NUM_COLS)
        page = tl.load(bt_row + tl.where(in_run, col, 0) * stride_bt_p, mask=in_run, other=-1).to(tl.int64)
        valid = in_run & (page >= 0)
        rows = state + page * stride_st_page + (sp % PAGE) * stride_st_tok
        if OVERLAP:  # slot s < m: the Ca half of the previous window's token; else the Cb half
            rows += tl.where(s < RATE, 0, W) * stride_st_f
        mask = valid[:, None] & f_ok[None, :]
        cols = offs_f[None, :] * stride_st_f
        v = tl.load(rows[:, None] + cols, mask=mask, other=0.0)
        g = tl.load(rows[:, None] + C * stride_st_f + cols, mask=mask, other=float("-inf")) * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(g, 0))
        alpha = tl.exp2(m_i - m_new)
        pw = tl.exp2(g - m_new[None, :])  # masked slots: exp2(-inf) = 0
        l_i = l_i * alpha + tl.sum(pw, 0)
        acc = acc * alpha + tl.sum(pw * v, 0)
        m_i = m_new
    pooled = tl.where(f_ok, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)

    normed = pooled * tl.rsqrt(tl.sum(pooled * pooled, 0) / W + eps)
    normed = normed * tl.load(norm_weight + offs_f, mask=f_ok, other=0.0).to(tl.float32)

    # interleaved RoPE on features W-R .. W-1 at position e·m: pairs (2j, 2j+1), angle j - (W-R)/2
    even, odd = tl.split(tl.reshape(normed, [BW // 2, 2]))
    j = tl.arange(0, BW // 2)
    i = j - (W - R) // 2
    rot = (i >= 0) & (i < R // 2)
    cs_row = cos_sin + (e * RATE) * stride_cs
    cos = tl.load(cs_row + i, mask=rot, other=1.0)
    sin = tl.load(cs_row + R // 2 + i, mask=rot, other=0.0)
    out = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), [BW])
    tl.store(dest + offs_f * stride_c_f, out.to(dest.dtype.element_ty), mask=f_ok)


@triton.jit
def _pool_kernel(
    positions, req_ids, block_table, state, norm_weight, cos_sin, compressed,
    stride_bt_b, stride_bt_p, stride_st_page, stride_st_tok, stride_st_f, stride_cs, stride_c_page, stride_c_row,
    stride_c_f,
    NUM_COLS,  # block_table.shape[1]
    eps,
    W: tl.constexpr, BW: tl.constexpr, R: tl.constexpr, RATE: tl.constexpr, PAGE: tl.constexpr,
    OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(positions + t).to(tl.int64)
    b = tl.load(req_ids + t).to(tl.int64)
    e = p // RATE
    bt_row = block_table + b * stride_bt_b
    # the entry lives on the page of its first token e·m, row (e·m % PAGE) // m
    first = e * RATE
    first_col = first // PAGE
    in_table = first_col < NUM_COLS
    dest_page = tl.load(bt_row + tl.where(in_table, first_col, 0) * stride_bt_p).to(tl.int64)
    if PAGE > RATE:
        row = (first % PAGE) // RATE
    else:
        row = first * 0
    if ((p + 1) % RATE == 0) & in_table & (dest_page >= 0):  # the token closes a window
        dest = compressed + dest_page * stride_c_page + row * stride_c_row
        _pool_entry(e, bt_row, state, norm_weight, cos_sin, dest, stride_bt_p, stride_st_page, stride_st_tok,
                    stride_st_f, stride_cs, stride_c_f, NUM_COLS, eps, W, BW, R, RATE, PAGE, OVERLAP, BLOCK_S)


def default_block_s(width: int, slots: int) -> int:
    """Slots per step of the pooling loop: about 4K float32 elements per [BLOCK_S, W] tile
    (two such tiles live at once), never more than the window has."""
    return max(1, min(triton.next_power_of_2(slots), 4096 // triton.next_power_of_2(width)))


def compressor_update(kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping,
                      block_table, state_cache, compressed_cache, compress_rate, overlap, eps, *, config=None):
    """Same arguments as ``mlagraph::compressor_update`` (already checked by its check)."""
    check_runnable("compressor_update", _pool_kernel, kv)
    num_tokens, width = kv.shape
    out_width = width // 2 if overlap else width
    rope_dim = cos_sin_cache.shape[1]
    if (out_width - rope_dim) % 2:  # the rotated pairs would not start at an even feature
        return torch.ops.mlagraph.compressor_update(
            kv, gate, position_bias, norm_weight, cos_sin_cache, positions, req_ids, slot_mapping, block_table,
            state_cache, compressed_cache, compress_rate, overlap, eps)
    if num_tokens == 0:
        return
    kv, gate = (x if x.stride(-1) == 1 else x.contiguous() for x in (kv, gate))
    position_bias, norm_weight, cos_sin_cache = (x.contiguous() for x in (position_bias, norm_weight, cos_sin_cache))
    positions, req_ids, slot_mapping = (x.contiguous() for x in (positions, req_ids, slot_mapping))
    page_size = state_cache.shape[1]
    st = state_cache.stride()
    _state_write_kernel[(num_tokens,)](
        kv, gate, position_bias, positions, slot_mapping, state_cache,
        kv.stride(0), gate.stride(0), position_bias.stride(0), st[0], st[1], st[2],
        C=width, RATE=compress_rate, PAGE=page_size, BC=triton.next_power_of_2(width), num_warps=4,
    )
    slots = 2 * compress_rate if overlap else compress_rate
    cfg = {"BLOCK_S": default_block_s(out_width, slots), "num_warps": 4}
    cfg.update(config or {})
    _pool_kernel[(num_tokens,)](
        positions, req_ids, block_table, state_cache, norm_weight, cos_sin_cache, compressed_cache,
        block_table.stride(0), block_table.stride(1), st[0], st[1], st[2], cos_sin_cache.stride(0),
        compressed_cache.stride(0), compressed_cache.stride(1), compressed_cache.stride(2), block_table.shape[1], eps,
        W=out_width, BW=max(2, triton.next_power_of_2(out_width)), R=rope_dim, RATE=compress_rate, PAGE=page_size,
        OVERLAP=bool(overlap), BLOCK_S=cfg["BLOCK_S"], num_warps=cfg["num_warps"],
    )
