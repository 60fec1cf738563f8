"""Gluon MLA for Hopper (sm_90) with the two warp groups on alternate key blocks: the "seesaw"
schedule, for ``mla_decode`` (bf16 caches, ``config={"FORM": "wgmma", "SEESAW": True}``) and
``sparse_mla`` (bf16, the same config); opt-in until the device says they beat
:mod:`.decode_wgmma` and :mod:`.sparse_wgmma`.

Same math, splits, masks and partial outputs as :mod:`.decode_wgmma` (read its docstring first).
What differs is who does what. There, both warp groups work on every block: each scores 32 of its
keys, so the softmax's row max and row sum cross warp groups through shared memory, and a CTA
barrier after each product keeps the tensor cores idle through every softmax. Here a pair of
blocks (K0, K1) is split between them, each warp group holding one half of the output's columns
(o_L: 0..255 in warp group 0, o_R: 256..511 in warp group 1; 128 registers a thread each):

    [0] S0 = q K0^T (all 576 columns); m0 = max(m, rowmax S0); P0 = exp2(S0 - m0)
        o_L = o_L * exp2(m - m0) + P0 V0_L                       sends m0, rowsum P0
    [1] S1 = q K1^T (meanwhile); m1 = max(m0, rowmax S1); P1 = exp2(S1 - m1)
        o_R = o_R * exp2(m - m1) + P1 V1_R                       sends m1, rowsum P1, P1
    [0] P0 *= exp2(m0 - m1) (now at m1's scale), sent; o_L = o_L * exp2(m0 - m1) + P1 V1_L
    [1] o_R += P0 V0_R;  both: m = m1, l = l * exp2(m - m1) + rowsum P0 * exp2(m0 - m1) + rowsum P1

which is the online softmax over K0 then K1 (DeepSeek's FlashMLA runs this schedule; the write-up
is theirs, the code ours). Each warp group's softmax runs while the other's products keep the
tensor cores busy, a row's max and sum never leave its warp group, and the only exchanges are a
block's P (8 KB) and two floats a row, through shared memory with mbarriers, no CTA barrier.

A third partition, one warp, is the loader: it issues each block as three copies (latent columns
0..255, 256..511, the rope part) into the pair's buffers, each copy's buffer refilled for the
next pair as soon as its last reader releases it (K0's rope after S0, K0_L after P0 V0_L, ...),
so the next pair's keys stream in while this pair is still being multiplied. The parts freed
last (K0_R after warp group 1's P0 V0_R, K1_L after warp group 0's P1 V1_L) are copied last and
multiplied last in the next pair's scores, which start on the parts already there. A split's
last, partial block is copied whole (one page's rows) and its rows past the split's end are
zeroed in shared memory by the warp group that multiplies them by P (0 weight x a stale NaN
would be NaN); a -1 page is read at a negative row: zeros, and its keys masked.

The sparse kernel (one program per token and 64 heads, as :mod:`.sparse_wgmma`'s) runs the
same two compute warp groups on a token's selected keys, 64 a block. Its loader is a whole warp
group (40 registers a thread): the copy engine cannot gather rows on Hopper, so each part is
gathered with asynchronous copies, 16 bytes a lane, each lane's copies arriving on the part's
ready barrier as they land, and the readers fence them for the tensor cores. A -1 index, a
position past the table or a -1 page is a masked copy: zeros, and its score masked.

Shared memory at L=512, R=64: q's latent part 64 KB (its rope part, 16 registers a thread, is
the scores' register operand) + 2 x 72 KB keys + 2 x 8 KB P + 1 KB of row exchanges = 225 KB:
one program an SM. Registers: the launch caps 12 warps (three warp groups) at 168 a thread and
each partition resets its own: the loader 40, each compute warp group 232 (sm_90 builds under
Triton 3.6: 320 B of spilled wgmma descriptors, dense; 408 B, sparse).
"""

from __future__ import annotations

from . import decode_wgmma

AVAILABLE = decode_wgmma.AVAILABLE
BLOCK_H = 64  # query rows a program: one wgmma M for each warp group
BLOCK_N = 64  # keys a block
NUM_WARPS = 4  # the kernel's own warps: warp group 0 (the second warp group and the loader are workers)
MAX_REGS = 168  # 3 warp groups x 128 threads x 168 <= 65536; setmaxnreg then moves them between groups


def shared_bytes(latent: int, rope: int) -> int:
    """Shared memory the kernel takes: q's latent part, two key blocks, two P tiles, the row
    exchanges and barriers (a bound the launcher checks against the SM's limit)."""
    return 2 * (BLOCK_H * latent + 2 * BLOCK_N * (latent + rope) + 2 * BLOCK_H * BLOCK_N) + 4 * 4 * BLOCK_H + 1024


if AVAILABLE:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .decode_wgmma import (_cta_barrier, _tma_load, fence_async_shared, gl, gluon, mbarrier, q_rows_to_shared,
                               split_run, warpgroup_mma, warpgroup_mma_wait, warpgroup_tile_layout, zero_rows_from)
    from .sparse_wgmma import copy_rows_async, token_keys, token_program

    # Registers a thread of each partition (setmaxnreg): each compute warp group, the loader.
    COMPUTE_REGS = gl.constexpr(232)
    LOADER_REGS = gl.constexpr(40)

    @gluon.constexpr_function
    def _s_layout():
        """S [64 rows, 64 keys] of one warp group: its 4 warps down the rows."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])

    @gluon.constexpr_function
    def _o_layout(cols):
        """A warp group's half of the output [64 rows, cols = L / 2]."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])

    @gluon.jit
    def _dense_kernel(
        q_nope, q_pe, cache, half_desc, pe_desc, block_table, seq_lens, out, lse,
        qk_scale,  # softmax_scale * log2(e)
        stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
        stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
        stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
        MAX_LEN,
        S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        MAX_SPLITS: gl.constexpr, DIRECT: gl.constexpr,
    ):
        """mla_decode: one program per (64 query rows, split, request), as decode_wgmma's."""
        BH: gl.constexpr = 64
        row_block, split, b, seq_len, lo, hi, n_blocks, bt_row = split_run(seq_lens, block_table, stride_sl,
                                                                           stride_bt_b, MAX_LEN, MAX_SPLITS)
        row0 = row_block * BH  # row r: query r // H, head r % H

        half_layout: gl.constexpr = half_desc.layout
        rope_layout: gl.constexpr = pe_desc.layout
        q_half = _q_latent_to_shared(q_nope + b * stride_qn_b, stride_qn_s, stride_qn_h, row0, S_Q * H, H, L,
                                     half_layout)
        k_half, k_rope, p_tiles, xchg, ready, free, sent = _allocate(half_layout, rope_layout, L, R, 1)
        # An empty split leaves its partial out unwritten (the combine never reads it).
        write_out = (lo < hi) | DIRECT
        # (each partition's arguments spelled out: a tuple assigned to a name first would turn its
        # constexprs into tensors)
        gl.warp_specialize([
            (_group0, (q_pe + b * stride_qp_b, stride_qp_s, stride_qp_h, row0, S_Q * H, bt_row, bt_row, stride_bt_p,
                       lo, hi, seq_len - S_Q, n_blocks, qk_scale,
                       out + b * stride_o_b + split * stride_o_split, stride_o_row,
                       lse + b * stride_lse_b + split * stride_lse_split, write_out,
                       q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent, H, L, R, PAGE, False)),
            (_group1, (q_pe + b * stride_qp_b, stride_qp_s, stride_qp_h, row0, S_Q * H, bt_row, bt_row, stride_bt_p,
                       lo, hi, seq_len - S_Q, n_blocks, qk_scale,
                       out + b * stride_o_b + split * stride_o_split, stride_o_row,
                       lse + b * stride_lse_b + split * stride_lse_split, write_out,
                       q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent, H, L, R, PAGE, False)),
            (_tma_loader, (half_desc, pe_desc, bt_row, stride_bt_p, lo, n_blocks, k_half, k_rope, ready, free, L,
                           PAGE)),
        ], [4, 1], [COMPUTE_REGS, LOADER_REGS])

    @gluon.jit
    def _sparse_kernel(
        qn_ptr, qp_ptr, cache_ptr, topk_ptr, req_ptr, bt_ptr, out_ptr, lse_ptr,
        num_heads, num_reqs, topk, max_len, qk_scale,  # qk_scale: softmax_scale * log2(e)
        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cp, stride_cs, stride_kt, stride_bt,
        stride_ot, stride_oh, stride_lt,
        L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
    ):
        """sparse_mla: one program per (token, 64 heads), as sparse_wgmma's (the head block
        fastest, so a token's two programs at H=128 read its rows side by side, the second from
        L2). Block j is the token's selected keys 64 j..64 j + 63."""
        BN: gl.constexpr = 64
        tok, head0 = token_program(num_heads)
        bt_row, topk_row, n_blocks = token_keys(req_ptr, bt_ptr, topk_ptr, tok, num_reqs, topk, stride_bt, stride_kt)

        half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, L // 2], gl.bfloat16)
        rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, R], gl.bfloat16)
        q_half = _q_latent_to_shared(qn_ptr + tok * stride_qnt, stride_qnh, 0, head0, num_heads, 1, L, half_layout)
        k_half, k_rope, p_tiles, xchg, ready, free, sent = _allocate(half_layout, rope_layout, L, R, 128)
        gl.warp_specialize([
            (_group0, (qp_ptr + tok * stride_qpt, stride_qph, 0, head0, num_heads, topk_row, bt_row, 1,
                       0, topk, max_len, n_blocks, qk_scale, out_ptr + tok * stride_ot, stride_oh,
                       lse_ptr + tok * stride_lt, True,
                       q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent, 1, L, R, PAGE, True)),
            (_group1, (qp_ptr + tok * stride_qpt, stride_qph, 0, head0, num_heads, topk_row, bt_row, 1,
                       0, topk, max_len, n_blocks, qk_scale, out_ptr + tok * stride_ot, stride_oh,
                       lse_ptr + tok * stride_lt, True,
                       q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent, 1, L, R, PAGE, True)),
            (_gather_loader, (cache_ptr, topk_row, bt_row, topk, max_len, stride_cp, stride_cs, n_blocks, k_half,
                              k_rope, ready, free, L, R, PAGE)),
        ], [4, 4], [COMPUTE_REGS, LOADER_REGS])  # the loader a whole warp group here

    @gluon.jit
    def _q_latent_to_shared(q_base, stride_s, stride_h, row0, n_rows, H: gl.constexpr, L: gl.constexpr,
                            layout: gl.constexpr):
        """q's latent part of rows row0..row0+63 (row r at q_base + (r // H) stride_s + (r % H)
        stride_h; rows >= n_rows: zeros) -> shared memory as two [64, L/2] halves."""
        q_half = gl.allocate_shared_memory(gl.bfloat16, [2, 64, L // 2], layout)
        for h in gl.static_range(2):
            q_rows_to_shared(q_base + h * (L // 2), stride_s, stride_h, row0, n_rows, H, q_half.index(h), L // 2)
        return q_half

    @gluon.jit
    def _allocate(half_layout: gl.constexpr, rope_layout: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                  READY_COUNT: gl.constexpr):
        """The pair's key buffers ([block of the pair (2) x latent half (2)] and [block (2)] rope),
        its P tiles, the row exchanges (0: m0, 1: rowsum P0, 2: m1, 3: rowsum P1) and barriers.
        Per copy (block b, part g: 0 latent left, 1 latent right, 2 rope; index 3 b + g): ready
        (its bytes landed: READY_COUNT arrivals) and free (its last reader is done). Then the
        exchanges, one arrival a pair each: m0 sent (0 -> 1), P1 sent (1 -> 0), P0 sent (0 -> 1)."""
        k_half = gl.allocate_shared_memory(gl.bfloat16, [4, 64, L // 2], half_layout)
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [2, 64, R], rope_layout)
        p_tiles = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64],
                                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        xchg = gl.allocate_shared_memory(gl.float32, [4 * 64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        ready = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        sent = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(6):
            mbarrier.init(ready.index(i), count=READY_COUNT)
            mbarrier.init(free.index(i), count=1)
        for i in gl.static_range(3):
            mbarrier.init(sent.index(i), count=1)
        fence_async_shared()
        _cta_barrier()
        return k_half, k_rope, p_tiles, xchg, ready, free, sent

    @gluon.jit
    def _tma_loader(half_desc, pe_desc, bt_row, stride_bt_p, lo, n_blocks, k_half, k_rope, ready, free,
                    L: gl.constexpr, PAGE: gl.constexpr):
        """Dense: each pair of blocks as six copies, in the order their slots are freed in the pair
        before (K0's and K1's rope parts after the scores, K0_L after P0 V0_L, K1_R after P1 V1_R,
        K0_R and K1_L last), so a copy never waits behind one that is freed later. A block lies in
        one page; a -1 page gives a negative row: zeros."""
        LH: gl.constexpr = L // 2
        for pair in range(0, (n_blocks + 1) // 2):
            phase, start0, start1, has1 = _pair(pair, lo, n_blocks)
            row0 = _page_row(bt_row, stride_bt_p, start0, True, PAGE)
            row1 = _page_row(bt_row, stride_bt_p, start1, has1, PAGE)  # unused without a block 1
            _copy(pe_desc, row0, L, free.index(2), ready.index(2), k_rope.index(0), phase, True)
            _copy(pe_desc, row1, L, free.index(5), ready.index(5), k_rope.index(1), phase, has1)
            _copy(half_desc, row0, 0, free.index(0), ready.index(0), k_half.index(0), phase, True)
            _copy(half_desc, row1, LH, free.index(4), ready.index(4), k_half.index(3), phase, has1)
            _copy(half_desc, row0, LH, free.index(1), ready.index(1), k_half.index(1), phase, True)
            _copy(half_desc, row1, 0, free.index(3), ready.index(3), k_half.index(2), phase, has1)

    @gluon.jit
    def _pair(pair, lo, n_blocks):
        """Pair ``pair`` of a run of blocks from key ``lo``: (its barriers' phase, block 0's first
        key, block 1's, whether block 1 exists: an odd run's last pair has block 0 only)."""
        start0 = lo + 2 * pair * 64
        return pair & 1, start0, start0 + 64, 2 * pair + 1 < n_blocks

    @gluon.jit
    def _page_row(bt_row, stride_bt_p, start, valid, PAGE: gl.constexpr):
        """The cache row of key ``start`` (a -1 page: a negative row, which the copy engine reads
        as zeros); the table is not read where not ``valid`` (past the split's blocks)."""
        page = gl.load(bt_row + (start // PAGE) * stride_bt_p, mask=valid, other=-1)
        return page * PAGE + start % PAGE

    @gluon.jit
    def _copy(desc, row, col, free_bar, ready_bar, buf, phase, pred):
        """One 64-row box at (row, col) into ``buf`` once its last reader has freed it (a fresh
        barrier's phase 1 counts as complete); nothing where ``pred`` is false."""
        if pred:
            mbarrier.wait(free_bar, phase ^ 1)
            mbarrier.expect(ready_bar, desc.block_type.nbytes)
            _tma_load(desc, [row, col], ready_bar, buf)

    @gluon.jit
    def _gather_loader(cache_ptr, topk_row, bt_row, topk, max_len, stride_cp, stride_cs, n_blocks, k_half, k_rope,
                       ready, free, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr):
        """Sparse: the same six parts a pair, in the same order, each gathered row by row with
        asynchronous copies (16 bytes a lane; the copy engine cannot gather rows on Hopper) by a
        warp group of 40 registers a thread, each lane's copies arriving on the part's ready
        barrier as they land (128 arrivals). A -1
        index, a position past the table or a -1 page is a masked copy: zeros."""
        LH: gl.constexpr = L // 2
        for pair in range(0, (n_blocks + 1) // 2):
            phase, j0, j1, has1 = _pair(pair, 0, n_blocks)
            _gather(cache_ptr, topk_row, bt_row, j0, topk, max_len, stride_cp, stride_cs, L, R, free.index(2),
                    ready.index(2), k_rope.index(0), phase, True, PAGE)
            _gather(cache_ptr, topk_row, bt_row, j1, topk, max_len, stride_cp, stride_cs, L, R, free.index(5),
                    ready.index(5), k_rope.index(1), phase, has1, PAGE)
            _gather(cache_ptr, topk_row, bt_row, j0, topk, max_len, stride_cp, stride_cs, 0, LH, free.index(0),
                    ready.index(0), k_half.index(0), phase, True, PAGE)
            _gather(cache_ptr, topk_row, bt_row, j1, topk, max_len, stride_cp, stride_cs, LH, LH, free.index(4),
                    ready.index(4), k_half.index(3), phase, has1, PAGE)
            _gather(cache_ptr, topk_row, bt_row, j0, topk, max_len, stride_cp, stride_cs, LH, LH, free.index(1),
                    ready.index(1), k_half.index(1), phase, True, PAGE)
            _gather(cache_ptr, topk_row, bt_row, j1, topk, max_len, stride_cp, stride_cs, 0, LH, free.index(3),
                    ready.index(3), k_half.index(2), phase, has1, PAGE)

    @gluon.jit
    def _gather(cache_ptr, topk_row, bt_row, start, topk, max_len, stride_cp, stride_cs, COL0: gl.constexpr,
                COLS: gl.constexpr, free_bar, ready_bar, buf, phase, pred, PAGE: gl.constexpr):
        """Columns COL0..COL0+COLS of the rows of selected keys start..start+63 -> buf [64, COLS],
        16 rows a step (4 copies a lane), once the buffer is free; the lanes' arrivals on
        ``ready_bar`` follow their copies."""
        RB: gl.constexpr = 16
        if pred:
            mbarrier.wait(free_bar, phase ^ 1)
            for r in gl.static_range(64 // RB):
                copy_rows_async(cache_ptr, topk_row, bt_row, start + r * RB, topk, max_len, stride_cp, stride_cs,
                                buf.slice(r * RB, RB, dim=0), COL0, PAGE, warpgroup_tile_layout(COLS))
            async_copy.mbarrier_arrive(ready_bar, increment_count=False)

    @gluon.jit
    def _q_rope_operand(qp_base, qp_s, qp_h, row0, n_rows, H: gl.constexpr, R: gl.constexpr):
        """q's rope part [64, R] in registers, as the scores' left operand (loaded in that layout:
        a conversion would take 8 KB of shared memory a warp group)."""
        layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_s_layout(), k_width=2)
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, R, layout=gl.SliceLayout(0, layout))
        ptrs = qp_base + (rows // H) * qp_s + (rows % H) * qp_h
        return gl.load(ptrs[:, None] + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0).to(gl.bfloat16)

    @gluon.jit
    def _ready(ready, i: gl.constexpr, phase, SPARSE: gl.constexpr):
        """Wait for copy i's bytes; gathered ones (written by the loader's lanes, not the copy
        engine) are then fenced for the tensor cores' reads."""
        mbarrier.wait(ready.index(i), phase)
        if SPARSE:
            fence_async_shared()

    @gluon.jit
    def _block_scores(q_half, q_rope, k_half, k_rope, ready, slot: gl.constexpr, phase, SPARSE: gl.constexpr):
        """S [64, 64] of the block in ``slot``: each of its three copies awaited in turn and its
        product issued as it lands, the part its slot frees last (K0_R, K1_L) last."""
        first: gl.constexpr = slot  # block 0: latent left first; block 1: latent right first
        s = gl.zeros([64, 64], gl.float32, layout=_s_layout())
        _ready(ready, slot * 3 + first, phase, SPARSE)
        s = warpgroup_mma(q_half.index(first), k_half.index(slot * 2 + first).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        _ready(ready, slot * 3 + 2, phase, SPARSE)
        s = warpgroup_mma(q_rope, k_rope.index(slot).permute((1, 0)), s, is_async=True)
        _ready(ready, slot * 3 + 1 - first, phase, SPARSE)
        s = warpgroup_mma(q_half.index(1 - first), k_half.index(slot * 2 + 1 - first).permute((1, 0)), s,
                          is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    @gluon.jit
    def _masked(s, keys_ptr, bt_row, stride_bt_p, start, hi, limit_base, row0, qk_scale, H: gl.constexpr,
                PAGE: gl.constexpr, SPARSE: gl.constexpr):
        """Scores in base 2, -inf where a key is not visible to a row. Dense (keys start..start+63
        of the cache): past the row's causal limit (limit_base + row // H), past the split's end
        ``hi``, or on a -1 page. Sparse (selected keys start..start+63 of ``keys_ptr``): past the
        ``hi`` selected, a -1 index, a position past ``limit_base`` (the table's length) or a -1
        page."""
        layout: gl.constexpr = _s_layout()
        keys = start + gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        if SPARSE:
            pos = gl.load(keys_ptr + keys, mask=keys < hi, other=-1)
            in_table = (pos >= 0) & (pos < limit_base)
            page = gl.load(bt_row + pos // PAGE, mask=in_table, other=-1)
            visible = (in_table & (page >= 0))[None, :]
        else:
            rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
            page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
            limit = limit_base + rows // H
            visible = (keys[None, :] <= limit[:, None]) & (keys < hi)[None, :] & (page >= 0)
        return gl.where(visible, s * qk_scale, float("-inf"))

    @gluon.jit
    def _safe(m):
        """A row max as a shift: a row that has seen no key (-inf) shifts by 0, so exp2 gives 0."""
        return gl.where(m == float("-inf"), 0.0, m)

    @gluon.jit
    def _pv(p, v_buf, o):
        """o += P @ v (P [64, 64] from registers or shared memory, v [64 keys, cols]), awaited."""
        o = warpgroup_mma(p, v_buf, o, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(o,))

    @gluon.jit
    def _send_rows(xchg, i: gl.constexpr, x):
        """Row values x [64] -> exchange slot i (read by the other warp group after an mbarrier)."""
        xchg.slice(i * 64, 64).store(x)

    @gluon.jit
    def _recv_rows(xchg, i: gl.constexpr, layout: gl.constexpr):
        """Exchange slot i as row values [64] in ``layout``."""
        return xchg.slice(i * 64, 64).load(layout)

    @gluon.jit
    def _group_start(qp_base, qp_s, qp_h, row0, n_rows, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr):
        """A compute warp group's state before any key: (q's rope operand, m = -inf, l = 0, its
        half of the output = 0)."""
        ROW_S: gl.constexpr = gl.SliceLayout(1, _s_layout())
        q_rope = _q_rope_operand(qp_base, qp_s, qp_h, row0, n_rows, H, R)
        m = gl.full([64], float("-inf"), gl.float32, layout=ROW_S)
        return q_rope, m, gl.zeros([64], gl.float32, layout=ROW_S), gl.zeros([64, L // 2], gl.float32,
                                                                               layout=_o_layout(L // 2))

    @gluon.jit
    def _group0(qp_base, qp_s, qp_h, row0, n_rows, keys_ptr, bt_row, stride_bt_p, lo, hi, limit_base, n_blocks,
                qk_scale, out_base, out_row_stride, lse_base, write_out,
                q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent,
                H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, SPARSE: gl.constexpr):
        """Warp group 0: the even blocks' scores and softmax; output columns 0..L/2, and lse."""
        BN: gl.constexpr = 64
        ROW_S: gl.constexpr = gl.SliceLayout(1, _s_layout())
        O_L: gl.constexpr = _o_layout(L // 2)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        q_rope, m, l_i, o = _group_start(qp_base, qp_s, qp_h, row0, n_rows, H, L, R)
        for pair in range(0, (n_blocks + 1) // 2):
            phase, start0, start1, has1 = _pair(pair, lo, n_blocks)
            s = _block_scores(q_half, q_rope, k_half, k_rope, ready, 0, phase, SPARSE)
            _cta_barrier()  # every warp past the scores' wait
            mbarrier.arrive(free.index(2))  # K0's rope part: read by S0 only
            s = _masked(s, keys_ptr, bt_row, stride_bt_p, start0, hi, limit_base, row0, qk_scale, H, PAGE, SPARSE)
            m0 = gl.maximum(m, gl.max(s, axis=1))
            p0 = gl.exp2(s - _safe(m0)[:, None])
            rs0 = gl.sum(p0, axis=1)
            p0 = gl.convert_layout(p0.to(gl.bfloat16), P_OP)  # the float32 tile dies here
            _send_rows(xchg, 0, m0)
            _send_rows(xchg, 1, rs0)
            _cta_barrier()
            mbarrier.arrive(sent.index(0))
            # o_L = o_L * exp2(m - m0) + P0 V0_L
            if not SPARSE:
                if start0 + BN > hi:
                    zero_rows_from(k_half.index(0), hi - start0)
            o = o * gl.convert_layout(gl.exp2(m - _safe(m0)), ROW_O)[:, None]
            o = _pv(p0, k_half.index(0), o)
            _cta_barrier()
            mbarrier.arrive(free.index(0))  # K0_L: S0 and P0 V0_L were its readers
            # P1 and m1 from warp group 1; P0 brought to m1's scale for its o_R
            mbarrier.wait(sent.index(1), phase)
            m1 = _recv_rows(xchg, 2, ROW_S)
            rs1 = _recv_rows(xchg, 3, ROW_S)
            scale1 = gl.exp2(m0 - _safe(m1))
            scale1_p = gl.convert_layout(scale1, gl.SliceLayout(1, P_OP))
            p_tiles.index(0).store((p0.to(gl.float32) * scale1_p[:, None]).to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(sent.index(2))
            o = o * gl.convert_layout(scale1, ROW_O)[:, None]
            if has1:  # o_L += P1 V1_L
                _ready(ready, 3, phase, SPARSE)  # complete (S1 read it); awaited for visibility here
                if not SPARSE:
                    if start1 + BN > hi:
                        zero_rows_from(k_half.index(2), hi - start1)
                o = _pv(p_tiles.index(1), k_half.index(2), o)
                _cta_barrier()
                mbarrier.arrive(free.index(3))  # K1_L: S1 (warp group 1, before it sent P1) and P1 V1_L
            l_i = l_i * gl.exp2(m - _safe(m1)) + rs0 * scale1 + rs1
            m = m1
        _finish(o, m, l_i, out_base, out_row_stride, lse_base, row0, n_rows, write_out, 0, True)

    @gluon.jit
    def _group1(qp_base, qp_s, qp_h, row0, n_rows, keys_ptr, bt_row, stride_bt_p, lo, hi, limit_base, n_blocks,
                qk_scale, out_base, out_row_stride, lse_base, write_out,
                q_half, k_half, k_rope, p_tiles, xchg, ready, free, sent,
                H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, SPARSE: gl.constexpr):
        """Warp group 1: the odd blocks' scores and softmax; output columns L/2..L."""
        BN: gl.constexpr = 64
        ROW_S: gl.constexpr = gl.SliceLayout(1, _s_layout())
        O_L: gl.constexpr = _o_layout(L // 2)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        q_rope, m, l_i, o = _group_start(qp_base, qp_s, qp_h, row0, n_rows, H, L, R)
        for pair in range(0, (n_blocks + 1) // 2):
            phase, start0, start1, has1 = _pair(pair, lo, n_blocks)
            if has1:
                s = _block_scores(q_half, q_rope, k_half, k_rope, ready, 1, phase, SPARSE)
                _cta_barrier()  # every warp past the scores' wait
                mbarrier.arrive(free.index(5))  # K1's rope part: read by S1 only
                s = _masked(s, keys_ptr, bt_row, stride_bt_p, start1, hi, limit_base, row0, qk_scale, H, PAGE,
                            SPARSE)
            else:  # an odd last block: nothing of K1, its scores all -inf
                s = gl.full([64, 64], float("-inf"), gl.float32, layout=_s_layout())
            mbarrier.wait(sent.index(0), phase)
            m0 = _recv_rows(xchg, 0, ROW_S)
            rs0 = _recv_rows(xchg, 1, ROW_S)
            m1 = gl.maximum(m0, gl.max(s, axis=1))
            p1 = gl.exp2(s - _safe(m1)[:, None])
            rs1 = gl.sum(p1, axis=1)
            p1 = gl.convert_layout(p1.to(gl.bfloat16), P_OP)  # the float32 tile dies here
            _send_rows(xchg, 2, m1)
            _send_rows(xchg, 3, rs1)
            if has1:
                p_tiles.index(1).store(p1)
                fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(sent.index(1))
            # o_R = o_R * exp2(m - m1) + P1 V1_R
            o = o * gl.convert_layout(gl.exp2(m - _safe(m1)), ROW_O)[:, None]
            if has1:
                if not SPARSE:
                    if start1 + BN > hi:
                        zero_rows_from(k_half.index(3), hi - start1)
                o = _pv(p1, k_half.index(3), o)
                _cta_barrier()
                mbarrier.arrive(free.index(4))  # K1_R: S1 and P1 V1_R
            # o_R += P0 V0_R, P0 at m1's scale
            mbarrier.wait(sent.index(2), phase)
            _ready(ready, 1, phase, SPARSE)  # complete (S0 read it); awaited for visibility here
            if not SPARSE:
                if start0 + BN > hi:
                    zero_rows_from(k_half.index(1), hi - start0)
            o = _pv(p_tiles.index(0), k_half.index(1), o)
            _cta_barrier()
            mbarrier.arrive(free.index(1))  # K0_R: S0 (warp group 0, before it sent m0) and P0 V0_R
            l_i = l_i * gl.exp2(m - _safe(m1)) + rs0 * gl.exp2(m0 - _safe(m1)) + rs1
            m = m1
        _finish(o, m, l_i, out_base, out_row_stride, lse_base, row0, n_rows, write_out, L // 2, False)

    @gluon.jit
    def _finish(o, m, l_i, out_base, out_row_stride, lse_base, row0, n_rows, write_out, COL0: gl.constexpr,
                WRITE_LSE: gl.constexpr):
        """This warp group's columns of out = o / l (rows row0.. at out_base + row * out_row_stride,
        in out's dtype; not written where not ``write_out``: an empty split, which the combine
        never reads), and (warp group 0) lse in natural log at lse_base + row. A row that saw no
        key: 0 and -inf."""
        layout: gl.constexpr = o.type.layout
        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        o = o * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, layout))[:, None]
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = COL0 + gl.arange(0, o.type.shape[1], layout=gl.SliceLayout(0, layout))
        ptrs = out_base + (row0 + rows)[:, None] * out_row_stride + cols[None, :]
        gl.store(ptrs, o.to(out_base.dtype.element_ty), mask=((row0 + rows < n_rows) & write_out)[:, None])
        if WRITE_LSE:
            rows_s = gl.arange(0, 64, layout=l_i.type.layout)
            row_lse = gl.where(has_key, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            gl.store(lse_base + row0 + rows_s, row_lse, mask=row0 + rows_s < n_rows)


def cache_descriptors(kv_cache, latent: int, rope: int):
    """(latent half, rope) Gluon tensor descriptors over a bf16 cache's rows [pages * page_size,
    W]: boxes of 64 rows x latent / 2 columns (read at columns 0 and latent / 2) and 64 x rope."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    half = gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent // 2], gl.bfloat16)
    pe = gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl.bfloat16)
    return (TensorDescriptor.from_tensor(rows, [BLOCK_N, latent // 2], half),
            TensorDescriptor.from_tensor(rows, [BLOCK_N, rope], pe))


def compile_for_sm90(s_q: int = 1, heads: int = 128, splits: int = 2, latent: int = 512, rope: int = 64,
                     page: int = 64):
    """The dense kernel built for sm_90 without a GPU (see :func:`.decode_wgmma.compile_for_sm90`)."""
    half = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent // 2], gl.bfloat16))
    pe = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl.bfloat16))
    types = {"q_nope": "*bf16", "q_pe": "*bf16", "cache": "*bf16", "block_table": "*i32", "seq_lens": "*i32",
             "out": "*fp32" if splits > 1 else "*bf16", "lse": "*fp32", "qk_scale": "fp32",
             "half_desc": f"tensordesc<bf16[{BLOCK_N},{latent // 2}],{half}>",
             "pe_desc": f"tensordesc<bf16[{BLOCK_N},{rope}],{pe}>"}
    consts = dict(S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page, MAX_SPLITS=splits, DIRECT=splits == 1)
    # the block table's and seq_lens' strides are 1 and stay unmarked
    return _compile(_dense_kernel, types, consts,
                    lambda n: n == "MAX_LEN" or n.startswith(("stride_q", "stride_c", "stride_o", "stride_lse")))


def compile_sparse_for_sm90(latent: int = 512, rope: int = 64, page: int = 64):
    """The sparse kernel built for sm_90 without a GPU."""
    types = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "cache_ptr": "*bf16", "topk_ptr": "*i32", "req_ptr": "*i32",
             "bt_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    consts = dict(L=latent, R=rope, PAGE=page)
    strides = {"stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_cp", "stride_cs", "stride_ot",
               "stride_oh"}
    return _compile(_sparse_kernel, types, consts, lambda n: n in strides)


def _compile(fn, types: dict, consts: dict, div16_int):
    """``fn`` built for sm_90: pointers and the integer arguments ``div16_int`` accepts marked
    16-divisible, as the JIT specialises them at a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div16 = [n for n, t in signature.items() if t.startswith("*") or (t == "i32" and div16_int(n))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS, "maxnreg": MAX_REGS})
