"""Triton ``swa_decode``, ``hca_decode``, ``csa_decode`` and their prefill forms ``swa_attention``,
``hca_attention``, ``csa_attention``: DeepSeek-V4's attentions.

Math (see :mod:`mlagraph.ops.swa`): one shared K=V row per key, per-head sinks,

    p[h, s] = exp(score[h, s]) / (sum_s exp(score[h, s]) + exp(sink[h])),   out[h] = sum_s p[h, s] k[s]

over the query's window keys (positions ``pos-window+1 .. pos``) and, in the same softmax, the
compressed entries it sees: all closed ones (HCA, ``(i+1)·m <= pos+1``) or the closed ones at
``topk_indices`` (CSA). Query i of request b sits at ``pos = seq_lens[b] - s_q + i``.

The prefill forms run the same kernel with ``PER_TOKEN``: each of the T tokens is one query
row at ``positions[t]`` over block-table row ``req_ids[t]`` (grid ``(cdiv(H, BLOCK_H), 1, T)``).
V4's attention is MQA, so one token's BLOCK_H heads already make a tensor-core tile against
each key row; neighbouring tokens re-read overlapping windows, from L2.

One kernel, ``_sink_decode_kernel``, for the three ops (MODE 0 / 1 / 2), grid
``(cdiv(H, BLOCK_H), s_q, B)``, fixed from shapes. A program owns BLOCK_H heads of one query: the
single K=V head is shared by every query head (MQA), so each key row it loads serves all of
them. It walks the window (at most ``window`` keys), then the entries, BLOCK_N rows at a time:
page ids from the block table, rows gathered (a -1 page, a position out of range or an entry
not yet closed masks the row, and masked rows load as 0, never as the cache's garbage), scores
with one tl.dot, an online softmax in base 2. The sink needs no special case: the running max
starts at the sink logit with a running sum of 1 (the sink's own term) and no value, so a query
with no key at all (a padding request) ends with out 0 and lse = sink, as the reference gives.

No split over keys: a V4 decode query reads at most window + top-k (128 + 512 for V4-Flash's
CSA) or window + seq_len / 128 (HCA) rows, so one program per (head block, query) is enough
work once the batch has a few requests. Small batches leave SMs idle (B = 1, 64 heads: 1 to 4
programs); a split-KV variant is the next step if the H200 numbers say so.

Dots: q's dtype on the GPU (p rounded to it; float32 queries use exact IEEE float32 dots),
softmax and accumulator in float32. The CPU interpreter runs every dot in float32 (its bf16 dot
is unreliable), as the MLA decode kernel does. Nothing reads tensor values on the host, so a
call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._hardware import hardware
from ._launch import check_runnable

_LOG2E = 1.4426950408889634
SWA, HCA, CSA = 0, 1, 2


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b, float32 accumulation; F32: exact float32 operands (no TF32)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend(qt, rows, valid, m_i, l_i, acc, qk_scale, D: tl.constexpr, BD: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_N: tl.constexpr, F32: tl.constexpr):
    """One block of BLOCK_N keys (row pointers ``rows``, mask ``valid``) into the online softmax
    of BLOCK_H query rows. m_i is always finite (it starts at the sink), so no -inf guard."""
    offs_d = tl.arange(0, BD)
    keys = tl.load(rows[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
    keys = keys.to(qt.dtype)
    s = _dot(qt, tl.trans(keys), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), F32) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(qt.dtype), keys, acc * alpha[:, None], F32)
    return m_new, l_i, acc


@triton.jit
def _sink_decode_kernel(
    q, window, compressed, topk, sinks, block_table, seq_lens, positions, req_ids, out, lse,
    qk_scale,  # softmax_scale * log2(e)
    stride_q_b, stride_q_s, stride_q_h, stride_w_page, stride_w_tok, stride_c_page, stride_c_row,
    stride_tk_b, stride_tk_s, stride_bt_b, stride_bt_p, stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s,
    MAX_LEN,  # block_table.shape[1] * page_size: positions past it do not exist
    K,  # top-k entries per query (CSA)
    S_Q: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, PAGE: tl.constexpr,
    WINDOW: tl.constexpr, RATE: tl.constexpr, MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    F32: tl.constexpr, PER_TOKEN: tl.constexpr,
):
    head_block = tl.program_id(0)
    i = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # the request (decode) or the token (PER_TOKEN: prefill)
    DOT_DTYPE: tl.constexpr = tl.float32 if F32 else q.dtype.element_ty
    if PER_TOKEN:  # token b of a ragged batch: its own position and block-table row
        pos = tl.load(positions + b).to(tl.int32)
        table_row = tl.load(req_ids + b).to(tl.int64)
    else:
        pos = tl.load(seq_lens + b) - S_Q + i  # < 0: a padding request, no key
        table_row = b

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < H
    offs_d = tl.arange(0, BD)
    q_row = q + b * stride_q_b + i * stride_q_s
    qt = tl.load(q_row + offs_h[:, None] * stride_q_h + offs_d[None, :],
                 mask=head_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(DOT_DTYPE)

    m_i = tl.load(sinks + offs_h, mask=head_ok, other=0.0) * 1.4426950408889634  # the sink, base 2
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)  # exp2(sink - m_i): the sink's term, no value
    acc = tl.zeros([BLOCK_H, BD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table + table_row * stride_bt_b

    # the window: positions max(pos - WINDOW + 1, 0) .. pos
    lo = tl.maximum(pos - WINDOW + 1, 0)
    hi = tl.minimum(pos + 1, MAX_LEN)
    for start in range(lo, hi, BLOCK_N):
        p = start + offs_n
        in_run = p < hi
        page = tl.load(bt_row + (p // PAGE) * stride_bt_p, mask=in_run, other=-1)
        valid = in_run & (page >= 0)
        rows = window + page.to(tl.int64) * stride_w_page + (p % PAGE) * stride_w_tok
        m_i, l_i, acc = _attend(qt, rows, valid, m_i, l_i, acc, qk_scale, D, BD, BLOCK_H, BLOCK_N, F32)

    # the compressed entries: entry e pools tokens e·RATE.. and lives on the page of its first
    # token, row (e·RATE % PAGE) // RATE (0 when RATE >= PAGE)
    if MODE != 0:
        n_closed = tl.maximum(pos + 1, 0) // RATE  # entries this query may see
        if MODE == 1:
            n_blocks = n_closed
        else:
            n_blocks = K
        tk_row = topk + b * stride_tk_b + i * stride_tk_s
        for start in range(0, n_blocks, BLOCK_N):
            j = start + offs_n
            if MODE == 1:
                e = j
                in_run = j < n_closed
            else:
                e = tl.load(tk_row + j, mask=j < K, other=-1)
                in_run = (e >= 0) & (e < n_closed)
            first = e * RATE
            in_run = in_run & (first < MAX_LEN)
            page = tl.load(bt_row + (first // PAGE) * stride_bt_p, mask=in_run, other=-1)
            valid = in_run & (page >= 0)
            rows = compressed + page.to(tl.int64) * stride_c_page + ((first % PAGE) // RATE) * stride_c_row
            m_i, l_i, acc = _attend(qt, rows, valid, m_i, l_i, acc, qk_scale, D, BD, BLOCK_H, BLOCK_N, F32)

    o = acc / l_i[:, None]
    o_ptrs = out + b * stride_o_b + i * stride_o_s + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=head_ok[:, None] & (offs_d[None, :] < D))
    tl.store(lse + b * stride_l_b + i * stride_l_s + offs_h, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=head_ok)


def default_config(batch: int, s_q: int, heads: int, q_dtype: torch.dtype, num_sms: int) -> dict:
    """Block sizes and warps from shapes only (not yet timed on the H200).

    - float32 queries (tests, float32 models) and the interpreter: 16 heads, 16 keys, 4 warps.
    - 16-bit queries: every head of the query in one block (up to 64: V4-Flash's 64 heads read
      each key row once), 32 keys a step, 8 warps for the float32 [64, D] accumulator (as the
      MLA decode kernel's 64-row config); when (query, head block) programs would not fill half
      the SMs, 16-head blocks (4 warps) trade re-reads from L2 for parallelism.
    """
    if q_dtype == torch.float32:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    full = min(64, max(16, triton.next_power_of_2(heads)))
    if batch * s_q * triton.cdiv(heads, full) < num_sms // 2:
        full = 16
    return {"BLOCK_H": full, "BLOCK_N": 32, "num_warps": 8 if full >= 64 else 4, "num_stages": 2}


def _launch(mode, q, kv_cache, compressed, topk, sinks, block_table, seq_lens, window, rate, softmax_scale,
            config=None, positions=None, req_ids=None):
    """q [B, s_q, H, D] with seq_lens [B] (decode), or with positions / req_ids [B] and s_q = 1
    (per token: the prefill ops' T tokens as B rows)."""
    per_token = positions is not None
    op = ("swa", "hca", "csa")[mode] + ("_attention" if per_token else "_decode")
    check_runnable(op, _sink_decode_kernel, q)
    batch, s_q, heads, dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, s_q, heads), dtype=torch.float32, device=q.device)
    if batch == 0 or s_q == 0 or heads == 0:
        return out, lse
    interpreted = q.device.type == "cpu"
    cfg = default_config(batch, s_q, heads, torch.float32 if interpreted else q.dtype, hardware(q.device).num_sms)
    cfg.update(config or {})
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    if compressed is None:
        compressed = kv_cache  # unused (MODE 0): any pointer
    elif compressed.stride(-1) != 1:
        compressed = compressed.contiguous()
    if per_token:
        positions, req_ids = positions.contiguous(), req_ids.contiguous()
        seq_lens = req_ids  # unused: any int32 pointer
    else:
        seq_lens = seq_lens.contiguous()
        positions = req_ids = seq_lens  # unused
    if topk is None:
        topk = seq_lens.view(1, 1, -1)  # unused (MODE 0 / 1): any int32 pointer
    page_size = kv_cache.shape[1]
    grid = (triton.cdiv(heads, cfg["BLOCK_H"]), s_q, batch)
    _sink_decode_kernel[grid](
        q, kv_cache, compressed, topk, sinks, block_table, seq_lens, positions, req_ids, out, lse,
        softmax_scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1), compressed.stride(0),
        compressed.stride(1), topk.stride(0), topk.stride(1), block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        block_table.shape[1] * page_size, topk.shape[-1],
        S_Q=s_q, H=heads, D=dim, BD=max(16, triton.next_power_of_2(dim)), PAGE=page_size, WINDOW=window,
        RATE=max(rate, 1), MODE=mode, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        F32=q.dtype == torch.float32 or interpreted, PER_TOKEN=per_token, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out, lse


# ---------------------------------------------------------------------------------------------
# entry points (arguments already checked by the generic ops' checks)


def swa_decode(q, kv_cache, sinks, block_table, seq_lens, window, softmax_scale, *, config=None):
    return _launch(SWA, q, kv_cache, None, None, sinks, block_table, seq_lens, window, 0, softmax_scale, config)


def hca_decode(q, kv_cache, compressed_cache, sinks, block_table, seq_lens, window, compress_rate, softmax_scale, *,
               config=None):
    return _launch(HCA, q, kv_cache, compressed_cache, None, sinks, block_table, seq_lens, window, compress_rate,
                   softmax_scale, config)


def csa_decode(q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window, compress_rate,
               softmax_scale, *, config=None):
    if topk_indices.stride(-1) != 1:
        topk_indices = topk_indices.contiguous()
    return _launch(CSA, q, kv_cache, compressed_cache, topk_indices, sinks, block_table, seq_lens, window,
                   compress_rate, softmax_scale, config)


# The prefill (ragged, any number of tokens per request) forms: every token one query row of
# the same kernel, at its own position, over its request's block-table row.


def _per_token(mode, q, kv_cache, compressed, topk, sinks, positions, req_ids, block_table, window, rate,
               softmax_scale, config):
    if topk is not None:
        topk = (topk if topk.stride(-1) == 1 else topk.contiguous())[:, None, :]
    out, lse = _launch(mode, q[:, None], kv_cache, compressed, topk, sinks, block_table, None, window, rate,
                       softmax_scale, config, positions=positions, req_ids=req_ids)
    return out[:, 0], lse[:, 0]


def swa_attention(q, kv_cache, sinks, positions, req_ids, block_table, window, softmax_scale, *, config=None):
    return _per_token(SWA, q, kv_cache, None, None, sinks, positions, req_ids, block_table, window, 0,
                      softmax_scale, config)


def hca_attention(q, kv_cache, compressed_cache, sinks, positions, req_ids, block_table, window, compress_rate,
                  softmax_scale, *, config=None):
    return _per_token(HCA, q, kv_cache, compressed_cache, None, sinks, positions, req_ids, block_table, window,
                      compress_rate, softmax_scale, config)


def csa_attention(q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table, window,
                  compress_rate, softmax_scale, *, config=None):
    return _per_token(CSA, q, kv_cache, compressed_cache, topk_indices, sinks, positions, req_ids, block_table,
                      window, compress_rate, softmax_scale, config)
