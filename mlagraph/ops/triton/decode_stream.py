"""Gluon ``mla_decode`` for the memory-bound row counts on Hopper (sm_90): the keys-major form
(:mod:`.decode_keys`) with a loader warp of its own, for the three cache layouts, opt-in
(``config={"FORM": "keys", "TMA": True, "WS": True}``) until the device says it beats the
Triton keys and rows forms.

Same math, orientation, splits, masks and partial outputs as :mod:`.decode_keys` (read its
docstring first): keys on the wgmma's M side (64 a block), the query rows (16 or 32) its N,

    sT   [64, N] = kv [64, L] @ q_lat^T [L, N] + pe [64, R] @ q_rope^T [R, N]
    accT [L, N] += kv^T [L, 64] @ pT [64, N]        (kv^T: the same shared-memory tile, transposed)

What differs is who loads. At these row counts a block's math is a few hundred nanoseconds and
its 72 KB of keys take microseconds to arrive, so the kernel is its copies. In the Triton keys
form the pipeliner issues a block's copy only once the previous block's products are done (read
in its TTGIR), so a program never has more than one block in flight, and on an H200 it trailed
FlashMLA and FlashInfer by a quarter (190 us against 143-146 at H=16, B=128, L=4096). Here one
warp does nothing but copy: it issues block j + 2 the moment block j's slot is freed, so both
slots are in flight whenever the math is waiting, and the four compute warps never issue a copy.
Each slot has a ``ready`` mbarrier (the copy engine's bytes landed) and a ``free`` one (both
products have read it).

Shared memory at L=512, R=64, 2 slots: 2 x 72 KB keys + q (N x 576 x 2 bytes: 18 KB at 16 rows,
36 KB at 32) + pT (2-4 KB): 166-184 KB, one program an SM (three slots do not fit). A split's
last, partial block is copied whole (one page's rows) and its latent rows past the split's end
are zeroed in shared memory before kv^T reads them (0 weight x a stale NaN would be NaN); a -1
page is read at a negative row: zeros, its keys masked.

The fp8 layouts read half the bytes, so they can be nearly twice as fast, if the widening stays
off the copies' path. The loader copies a block's raw bytes (e4m3 latent; the rope, e4m3 for
fp8 and bf16 for fp8_ds; fp8_ds's float32 group scales) into one of 2-3 slots; the compute
warps widen the latent into one fp16 tile (e4m3 -> fp16 is exact; fp8_ds times the row's scale
of each 128-column group, rounded once to fp16, as the Triton forms do) and give the slot back
before the products (fp8) or right after the scores (fp8_ds, whose bf16 rope they read in
place), so while they multiply the loader already refills it. fp8's per-tensor scale is folded
into the scores and the output. Shared memory at 16 rows, 3 slots: 205-212 KB.
"""

from __future__ import annotations

from . import decode_wgmma

AVAILABLE = decode_wgmma.AVAILABLE
BLOCK_N = 64  # keys a block: one wgmma M
NUM_WARPS = 4  # the compute warp group; the loader is one more warp
STAGES = 2  # key slots (a third does not fit beside q at L=512)


def shared_bytes(rows: int, latent: int, rope: int, layout: str = "bf16", stages: int = STAGES) -> int:
    """Shared memory a kernel takes at most (``rows`` = its N, 16 or 32): the slots, q, pT, for
    the fp8 layouts the fp16 tiles widened from a slot, and 1 KB for the compiler's cross-warp
    reductions."""
    q_and_p = 2 * (rows * (latent + rope) + BLOCK_N * rows) + 1024
    if layout == "bf16":
        return 2 * stages * BLOCK_N * (latent + rope) + q_and_p
    rope_bytes = rope if layout == "fp8" else 2 * rope
    slot = BLOCK_N * (latent + rope_bytes + 4 * (latent // 128))  # e4m3 latent, rope, group scales
    return stages * slot + 2 * BLOCK_N * (latent + rope) + q_and_p


def pick_stages(rows: int, latent: int, rope: int, layout: str) -> int:
    """The most slots (2 or 3) that fit an SM's shared memory: for bf16 always 2 at L=512."""
    fits = [n for n in (3, 2) if shared_bytes(rows, latent, rope, layout, n) <= decode_wgmma.SHARED_LIMIT]
    return fits[0] if fits else 2


def check_stages(rows: int, latent: int, rope: int, layout: str, stages: int) -> None:
    """A ValueError unless ``stages`` >= 2 slots fit beside the rest."""
    need = shared_bytes(rows, latent, rope, layout, stages)
    if stages < 2 or need > decode_wgmma.SHARED_LIMIT:
        raise ValueError(f"mla_decode config: WS needs num_stages >= 2 within {decode_wgmma.SHARED_LIMIT} B of shared "
                         f"memory, got {stages} ({need} B for {rows} rows of a {layout!r} cache)")


def why_not(q_nope, kv_cache, layout: str, latent: int, rope: int) -> str | None:
    """Why these kernels cannot run a call (None: as far as they go, they can): Gluon, a Hopper
    GPU, bf16 queries, DeepSeek's widths; any of the three cache layouts."""
    import torch

    if not AVAILABLE:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if q_nope.device.type != "cuda" or torch.cuda.get_device_capability(q_nope.device) != (9, 0):
        return "it needs a Hopper GPU (sm_90: warp-group MMA)"
    if q_nope.dtype != torch.bfloat16:
        return f"it takes bf16 queries, got {q_nope.dtype}"
    if (latent, rope) != (512, 64):
        return f"kv_lora_rank {latent} / rope dim {rope}: it runs DeepSeek's 512 / 64"
    return None


if AVAILABLE:
    from .decode_wgmma import (_cta_barrier, _tma_load, fence_async_shared, gl, gluon, mbarrier, q_rows_to_shared,
                               split_run, warpgroup_mma, warpgroup_mma_wait, zero_rows_from)

    @gluon.constexpr_function
    def _acc_layout(n):
        """A keys-major product's result [M, n] on 4 warps: each warp 16 of every 64 rows of M."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _stream_kernel(
        q_nope, q_pe, cache, lat_desc, pe_desc, block_table, seq_lens, out, lse,
        qk_scale,  # softmax_scale * log2(e)
        stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
        stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
        stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
        MAX_LEN,
        S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_H: gl.constexpr, MAX_SPLITS: gl.constexpr, DIRECT: gl.constexpr,
    ):
        BN: gl.constexpr = 64
        NS: gl.constexpr = 2  # STAGES
        row_block, split, b, seq_len, lo, hi, n_blocks, bt_row = split_run(seq_lens, block_table, stride_sl,
                                                                           stride_bt_b, MAX_LEN, MAX_SPLITS)
        row0 = row_block * BLOCK_H  # row r: query r // H, head r % H

        # q -> shared memory, [BLOCK_H, L] and [BLOCK_H, R] (the products' B side, transposed views).
        q_lat = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, L],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], gl.bfloat16))
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16))
        q_rows_to_shared(q_nope + b * stride_qn_b, stride_qn_s, stride_qn_h, row0, S_Q * H, H, q_lat, L)
        q_rows_to_shared(q_pe + b * stride_qp_b, stride_qp_s, stride_qp_h, row0, S_Q * H, H, q_rope, R)
        k_lat = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, L], lat_desc.layout)
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, R], pe_desc.layout)
        p_t = gl.allocate_shared_memory(gl.bfloat16, [BN, BLOCK_H],
                                        gl.NVMMASharedLayout.get_default_for([BN, BLOCK_H], gl.bfloat16))
        ready, free = _slot_barriers(NS)

        # An empty split leaves its partial out unwritten (the combine never reads it).
        write_out = (lo < hi) | DIRECT
        # (each partition's arguments spelled out: a tuple assigned to a name first would turn its
        # constexprs into tensors)
        gl.warp_specialize([
            (_compute, (q_lat, q_rope, k_lat, k_rope, p_t, ready, free, bt_row, stride_bt_p, lo, hi, n_blocks,
                        seq_len - S_Q, row0, qk_scale,
                        out + b * stride_o_b + split * stride_o_split, stride_o_row,
                        lse + b * stride_lse_b + split * stride_lse_split, write_out, S_Q * H, H, L, PAGE,
                        BLOCK_H)),
            (_loader, (lat_desc, pe_desc, bt_row, stride_bt_p, lo, n_blocks, k_lat, k_rope, ready, free, L, PAGE)),
        ], [1], [40])

    @gluon.jit
    def _slot_barriers(NS: gl.constexpr):
        """(ready, free) [NS] mbarriers, one arrival each: the loader's bytes landed in a slot; its
        last reader is done with it."""
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
        fence_async_shared()
        _cta_barrier()
        return ready, free

    @gluon.jit
    def _loader(lat_desc, pe_desc, bt_row, stride_bt_p, lo, n_blocks, k_lat, k_rope, ready, free,
                L: gl.constexpr, PAGE: gl.constexpr):
        """Block j of the split into slot j % 2 once both products have read the block before it
        there (a fresh barrier's phase 1 counts as complete)."""
        for j in range(0, n_blocks):
            slot = j % 2
            start = lo + j * 64
            page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
            row = page * PAGE + start % PAGE  # a -1 page: a negative row, read as zeros
            mbarrier.wait(free.index(slot), ((j // 2) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
            _tma_load(lat_desc, [row, 0], ready.index(slot), k_lat.index(slot))
            _tma_load(pe_desc, [row, L], ready.index(slot), k_rope.index(slot))

    @gluon.jit
    def _compute(q_lat, q_rope, k_lat, k_rope, p_t, ready, free, bt_row, stride_bt_p, lo, hi, n_blocks, limit_base,
                 row0, qk_scale, out_base, out_row_stride, lse_base, write_out, n_rows,
                 H: gl.constexpr, L: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr):
        """The online softmax (base 2) down the key axis, one block at a time as the loader lands
        them; then this split's out (o / l, transposed back) and lse."""
        BN: gl.constexpr = 64
        S_L: gl.constexpr = _acc_layout(BLOCK_H)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)  # per query row
        rows = row0 + gl.arange(0, BLOCK_H, layout=COL_S)
        limit = limit_base + rows // H  # each row's causal limit
        keys = gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=COL_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=COL_S)
        acc_t = gl.zeros([L, BLOCK_H], gl.float32, layout=S_L)
        for j in range(0, n_blocks):
            slot = j % 2
            start = lo + j * BN
            kl = k_lat.index(slot)
            mbarrier.wait(ready.index(slot), (j // 2) & 1)
            if start + BN > hi:  # the split's partial last block: its stale rows -> 0
                zero_rows_from(kl, hi - start)
            visible = _visible(bt_row, stride_bt_p, start, hi, limit, keys, PAGE)
            m_i, l_i, acc_t = _block_step(kl, k_rope.index(slot), q_lat, q_rope, p_t, visible, qk_scale, m_i, l_i,
                                          acc_t, free.index(slot), False, BLOCK_H)
            _cta_barrier()  # every warp done with the slot and pT
            mbarrier.arrive(free.index(slot))
        _finish(acc_t, m_i, l_i, 1.0, rows, out_base, out_row_stride, lse_base, write_out, n_rows, L)

    @gluon.jit
    def _visible(bt_row, stride_bt_p, start, hi, limit, keys, PAGE: gl.constexpr):
        """[64 keys, rows]: a key is visible to a row up to the row's causal limit, before the
        split's end, and not on a -1 page."""
        page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
        pos = start + keys
        return (pos[:, None] <= limit[None, :]) & (pos < hi)[:, None] & (page >= 0)

    @gluon.jit
    def _block_step(kl, kr, q_lat, q_rope, p_t, visible, scale, m_i, l_i, acc_t, free_bar, FREE_AT_SCORES: gl.constexpr,
                    BLOCK_H: gl.constexpr):
        """One block of 64 keys (kl [64, L], kr [64, R] in shared memory) into the online softmax
        (base 2), keys-major: sT = kl q_lat^T + kr q_rope^T, pT through p_t, accT += kl^T pT.
        FREE_AT_SCORES: ``free_bar`` is arrived on once the scores are read (kr lives in the
        loader's slot, kl does not). Returns (m, l, accT); pT and kl still read by nobody."""
        s_zero = gl.zeros([64, BLOCK_H], gl.float32, layout=_acc_layout(BLOCK_H))
        s_t = warpgroup_mma(kl, q_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma(kr, q_rope.permute((1, 0)), s_t, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
        if FREE_AT_SCORES:
            _cta_barrier()
            mbarrier.arrive(free_bar)
        s_t = gl.where(visible, s_t * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s_t - m_safe[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        p_t.store(p.to(p_t.dtype))
        fence_async_shared()
        _cta_barrier()  # all of pT written before the product reads it
        acc_t = acc_t * alpha[None, :]
        acc_t = warpgroup_mma(kl.permute((1, 0)), p_t, acc_t, is_async=True)
        acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
        return m_new, l_i, acc_t

    @gluon.jit
    def _finish(acc_t, m_i, l_i, out_scale, rows, out_base, out_row_stride, lse_base, write_out, n_rows,
                L: gl.constexpr):
        """This split's out = accT^T * out_scale / l (rows past n_rows, and an empty split's
        partial out, not written) and lse (natural log); a row that saw no key: 0 and -inf."""
        layout: gl.constexpr = _acc_layout(acc_t.shape[1])
        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        o_t = acc_t * (out_scale / l_safe)[None, :]
        cols = gl.arange(0, L, layout=gl.SliceLayout(1, layout))
        ptrs = out_base + rows[None, :] * out_row_stride + cols[:, None]
        gl.store(ptrs, o_t.to(out_base.dtype.element_ty), mask=((rows < n_rows) & write_out)[None, :])
        row_lse = gl.where(has_key, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_base + rows, row_lse, mask=rows < n_rows)

    @gluon.jit
    def _stream_fp8_kernel(
        q_nope, q_pe, cache, lat_desc, pe_desc, sc_desc, block_table, seq_lens, fp8_scale, out, lse,
        qk_scale,  # softmax_scale * log2(e)
        stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
        stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
        stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
        MAX_LEN,
        S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_H: gl.constexpr, MAX_SPLITS: gl.constexpr, DIRECT: gl.constexpr, LAYOUT: gl.constexpr,
        NS: gl.constexpr,
    ):
        """The fp8 layouts (LAYOUT 1: fp8, L + R e4m3 bytes and a per-tensor scale; 2: fp8_ds, L
        e4m3 | L/128 float32 scales | R bf16): the loader copies a block's raw bytes into one of NS
        slots; the compute warps widen its latent into an fp16 tile (times its row's group scale
        for fp8_ds; e4m3 -> fp16 is exact) and run the bf16 form's products on it, so the slot
        goes back to the loader as soon as it is read and half of bf16's bytes stream in."""
        BN: gl.constexpr = 64
        G: gl.constexpr = L // 128
        row_block, split, b, seq_len, lo, hi, n_blocks, bt_row = split_run(seq_lens, block_table, stride_sl,
                                                                           stride_bt_b, MAX_LEN, MAX_SPLITS)
        row0 = row_block * BLOCK_H

        RT: gl.constexpr = gl.float16 if LAYOUT == 1 else gl.bfloat16  # the rope product's dtype
        q_lat = gl.allocate_shared_memory(gl.float16, [BLOCK_H, L],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], gl.float16))
        q_rope = gl.allocate_shared_memory(RT, [BLOCK_H, R], gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], RT))
        q_rows_to_shared(q_nope + b * stride_qn_b, stride_qn_s, stride_qn_h, row0, S_Q * H, H, q_lat, L)
        q_rows_to_shared(q_pe + b * stride_qp_b, stride_qp_s, stride_qp_h, row0, S_Q * H, H, q_rope, R)
        raw_lat = gl.allocate_shared_memory(gl.uint8, [NS, BN, L], lat_desc.layout)
        raw_rope = gl.allocate_shared_memory(pe_desc.dtype, [NS, BN, R], pe_desc.layout)
        raw_sc = gl.allocate_shared_memory(gl.float32, [NS, BN, G], sc_desc.layout)  # fp8_ds only
        kv16 = gl.allocate_shared_memory(gl.float16, [BN, L],
                                         gl.NVMMASharedLayout.get_default_for([BN, L], gl.float16))
        rope16 = gl.allocate_shared_memory(gl.float16, [BN, R],
                                           gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        p_t = gl.allocate_shared_memory(gl.float16, [BN, BLOCK_H],
                                        gl.NVMMASharedLayout.get_default_for([BN, BLOCK_H], gl.float16))
        ready, free = _slot_barriers(NS)

        write_out = (lo < hi) | DIRECT
        gl.warp_specialize([
            (_compute_fp8, (q_lat, q_rope, raw_lat, raw_rope, raw_sc, kv16, rope16, p_t, ready, free, bt_row,
                            stride_bt_p, lo, hi, n_blocks, seq_len - S_Q, row0, qk_scale, fp8_scale,
                            out + b * stride_o_b + split * stride_o_split, stride_o_row,
                            lse + b * stride_lse_b + split * stride_lse_split, write_out, S_Q * H, H, L, PAGE,
                            BLOCK_H, LAYOUT, NS)),
            (_fp8_loader, (lat_desc, pe_desc, sc_desc, bt_row, stride_bt_p, lo, n_blocks, raw_lat, raw_rope, raw_sc,
                           ready, free, L, R, PAGE, LAYOUT, NS)),
        ], [1], [40])

    @gluon.jit
    def _fp8_loader(lat_desc, pe_desc, sc_desc, bt_row, stride_bt_p, lo, n_blocks, raw_lat, raw_rope, raw_sc, ready,
                    free, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, LAYOUT: gl.constexpr,
                    NS: gl.constexpr):
        """Block j's raw bytes (latent, rope, and fp8_ds's scales) into slot j % NS once it is free."""
        for j in range(0, n_blocks):
            slot = j % NS
            start = lo + j * 64
            page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
            row = page * PAGE + start % PAGE  # a -1 page: a negative row, read as zeros
            mbarrier.wait(free.index(slot), ((j // NS) & 1) ^ 1)
            if LAYOUT == 2:
                mbarrier.expect(ready.index(slot), lat_desc.block_type.nbytes + pe_desc.block_type.nbytes
                                + sc_desc.block_type.nbytes)
                _tma_load(lat_desc, [row, 0], ready.index(slot), raw_lat.index(slot))
                _tma_load(sc_desc, [row, L // 4], ready.index(slot), raw_sc.index(slot))  # float32 columns
                _tma_load(pe_desc, [row, (L + L // 32) // 2], ready.index(slot), raw_rope.index(slot))  # bf16 columns
            else:
                mbarrier.expect(ready.index(slot), lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
                _tma_load(lat_desc, [row, 0], ready.index(slot), raw_lat.index(slot))
                _tma_load(pe_desc, [row, L], ready.index(slot), raw_rope.index(slot))

    @gluon.jit
    def _compute_fp8(q_lat, q_rope, raw_lat, raw_rope, raw_sc, kv16, rope16, p_t, ready, free, bt_row, stride_bt_p, lo,
                     hi, n_blocks, limit_base, row0, qk_scale, fp8_scale, out_base, out_row_stride, lse_base,
                     write_out, n_rows, H: gl.constexpr, L: gl.constexpr, PAGE: gl.constexpr,
                     BLOCK_H: gl.constexpr, LAYOUT: gl.constexpr, NS: gl.constexpr):
        """The bf16 form's loop over fp16 tiles widened from each slot's e4m3 bytes."""
        BN: gl.constexpr = 64
        S_L: gl.constexpr = _acc_layout(BLOCK_H)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
        rows = row0 + gl.arange(0, BLOCK_H, layout=COL_S)
        limit = limit_base + rows // H
        keys = gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=COL_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=COL_S)
        acc_t = gl.zeros([L, BLOCK_H], gl.float32, layout=S_L)
        # fp8: one scale for the whole cache, folded into the scores and the output
        kv_scale = 1.0
        if LAYOUT == 1:
            kv_scale = gl.load(fp8_scale)
        for j in range(0, n_blocks):
            slot = j % NS
            start = lo + j * BN
            mbarrier.wait(ready.index(slot), (j // NS) & 1)
            # past the split's end (the partial last block): 0, never the page's stale bytes
            _widen_latent(raw_lat.index(slot), raw_sc.index(slot), kv16, hi - start, LAYOUT)
            if LAYOUT == 1:
                _widen_rope(raw_rope.index(slot), rope16)
            fence_async_shared()
            _cta_barrier()  # the fp16 tiles whole before the products read them
            visible = _visible(bt_row, stride_bt_p, start, hi, limit, keys, PAGE)
            if LAYOUT == 1:  # every byte of the slot read: back to the loader before the math
                mbarrier.arrive(free.index(slot))
                m_i, l_i, acc_t = _block_step(kv16, rope16, q_lat, q_rope, p_t, visible, qk_scale * kv_scale, m_i,
                                              l_i, acc_t, free.index(slot), False, BLOCK_H)
            else:  # fp8_ds: the bf16 rope is read in place, by the scores
                m_i, l_i, acc_t = _block_step(kv16, raw_rope.index(slot), q_lat, q_rope, p_t, visible, qk_scale,
                                              m_i, l_i, acc_t, free.index(slot), True, BLOCK_H)
            _cta_barrier()  # every warp done with kv16 and pT before the next block overwrites them
        _finish(acc_t, m_i, l_i, kv_scale, rows, out_base, out_row_stride, lse_base, write_out, n_rows, L)

    @gluon.constexpr_function
    def _byte_layout(cols):
        """Registers of a [16, cols] byte tile on 4 warps, 16 bytes a thread (8 below 128 columns)."""
        vec = 16 if cols >= 128 else 8
        return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 * vec // cols, cols // vec],
                                warps_per_cta=[4, 1], order=[1, 0])

    @gluon.jit
    def _widen_latent(raw, sc, kv16, valid, LAYOUT: gl.constexpr):
        """raw [64, L] e4m3 bytes -> kv16 [64, L] fp16 (times each row's float32 scale of its
        128-column group for fp8_ds), in [16, 128] pieces; rows ``valid``.. -> 0."""
        layout: gl.constexpr = _byte_layout(128)
        G: gl.constexpr = raw.shape[1] // 128
        for r in gl.static_range(4):
            rows = r * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            keep = (rows < valid)[:, None]
            for c in gl.static_range(G):
                x = raw.slice(r * 16, 16, dim=0).slice(c * 128, 128, dim=1).load(layout)
                x = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
                if LAYOUT == 2:
                    s = sc.slice(r * 16, 16, dim=0).slice(c, 1, dim=1).load(layout)  # [16, 1]
                    x = (x.to(gl.float32) * s).to(gl.float16)
                kv16.slice(r * 16, 16, dim=0).slice(c * 128, 128, dim=1).store(gl.where(keep, x, 0.0))

    @gluon.jit
    def _widen_rope(raw, rope16):
        """fp8's rope: raw [64, R] e4m3 bytes -> rope16 [64, R] fp16 (stale rows' scores are masked)."""
        layout: gl.constexpr = _byte_layout(raw.shape[1])
        for r in gl.static_range(4):
            x = raw.slice(r * 16, 16, dim=0).load(layout)
            rope16.slice(r * 16, 16, dim=0).store(x.to(gl.float8e4nv, bitcast=True).to(gl.float16))


def _fp8_layouts(layout: str, latent: int, rope: int):
    """The fp8 kernel's descriptor boxes: (dtype, block shape) of its latent, rope and scale copies."""
    pe = ("uint8" if layout == "fp8" else "bfloat16", [BLOCK_N, rope])
    return ("uint8", [BLOCK_N, latent]), pe, ("float32", [BLOCK_N, latent // 128])


def cache_descriptors(kv_cache, layout: str, latent: int, rope: int):
    """The kernels' tensor descriptors over a cache's rows [pages * page_size, W]: bf16, (latent,
    rope) as :func:`.decode_wgmma.cache_descriptors`; fp8 layouts, (latent bytes, rope, scales)
    with the rope as bf16 columns for fp8_ds (656-byte rows) and its scales as float32 columns
    (for fp8 the scale descriptor is a stand-in, never read)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if layout == "bf16":
        return decode_wgmma.cache_descriptors(kv_cache, latent, rope)
    rows = kv_cache.reshape(-1, kv_cache.shape[-1]).view(torch.uint8)
    views = {"uint8": rows, "bfloat16": rows.view(torch.bfloat16), "float32": rows.view(torch.float32)}
    descs = []
    for dtype, block in _fp8_layouts(layout, latent, rope):
        shared = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, dtype))
        descs.append(TensorDescriptor.from_tensor(views[dtype], block, shared))
    return tuple(descs)


def compile_for_sm90(s_q: int = 1, heads: int = 16, splits: int = 1, latent: int = 512, rope: int = 64,
                     page: int = 64, layout: str = "bf16", stages: int = 2):
    """A kernel built for sm_90 without a GPU (see :func:`.decode_wgmma.compile_for_sm90`): the
    bf16 one, or for ``layout`` fp8 / fp8_ds the fp8 one with ``stages`` slots."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    short = {"uint8": "u8", "bfloat16": "bf16", "float32": "fp32"}
    types = {"q_nope": "*bf16", "q_pe": "*bf16", "cache": "*bf16" if layout == "bf16" else "*u8",
             "block_table": "*i32", "seq_lens": "*i32", "fp8_scale": "*fp32",
             "out": "*fp32" if splits > 1 else "*bf16", "lse": "*fp32", "qk_scale": "fp32"}
    block_h = max(16, triton.next_power_of_2(s_q * heads))
    consts = dict(S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page, BLOCK_H=block_h, MAX_SPLITS=splits,
                  DIRECT=splits == 1)
    if layout == "bf16":
        fn = _stream_kernel
        boxes = {"lat_desc": ("bfloat16", [BLOCK_N, latent]), "pe_desc": ("bfloat16", [BLOCK_N, rope])}
    else:
        fn = _stream_fp8_kernel
        boxes = dict(zip(("lat_desc", "pe_desc", "sc_desc"), _fp8_layouts(layout, latent, rope)))
        consts.update(LAYOUT={"fp8": 1, "fp8_ds": 2}[layout], NS=stages)
    for name, (dtype, block) in boxes.items():
        shared = repr(gl.NVMMASharedLayout.get_default_for(block, getattr(gl, dtype)))
        types[name] = f"tensordesc<{short[dtype]}[{block[0]},{block[1]}],{shared}>"
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div16 = [n for n, t in signature.items()
             if t.startswith("*") or n == "MAX_LEN" or n.startswith(("stride_q", "stride_c", "stride_o", "stride_lse"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})
