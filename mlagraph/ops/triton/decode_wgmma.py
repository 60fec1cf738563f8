"""Gluon ``mla_decode`` for Hopper (sm_90), bf16 caches at DeepSeek's widths, 64 query rows a
program: the default past 16 rows (H=128 is two programs a request; 24-32 rows pad the block).

Same math, splits, masks and partial outputs as :mod:`.decode`'s rows-major ``_split_kernel``
(read its docstring first); the combine kernel is shared. Why another form: in Triton a dot whose
result feeds another dot gets all its warps along M, so with 64 rows and 8 warps both warp groups
compute the same q.k scores, and the latent half of the FLOPs runs twice (H=128 on an H100:
0.34x FlashMLA). Gluon lets the layouts be chosen by hand:

    S   [64 rows, 64 keys] = q [64, L+R] @ k^T    warps [4, 2]: each warp group 32 of the keys
    P   = exp2(S - m) -> shared memory             (both warp groups read all 64 keys of it)
    acc [64 rows, L]      += P @ kv [64, L]       warps [4, 2]: each warp group L/2 columns

so every multiply-add runs once. The keys arrive through the copy engine (TMA), STAGES blocks in
flight: a split's whole 64-key blocks each lie in one page (the launcher asks page_size % 64 == 0
and pages back to back), a -1 page is put at a negative row (read as zeros, its keys masked). A
split's last, partial block is gathered with masked loads into the same buffers, 32 keys at a
time, so keys past the length are zeros in shared memory, never the cache's stale bytes (0
weight x NaN would be NaN).

Shared memory at L=512, R=64, 2 stages: q 72 KB + 2 x 72 KB keys + 8 KB P = 224 KB: one program
an SM. Registers: the float32 accumulator is 128 a thread (sm_90 builds: 244-255 in all).

The two products of a block run back to back (a CTA barrier after each), so the tensor cores
idle through the softmax; ``OVERLAP`` (opt-in) issues block j+1's scores right behind block j's
P @ kv. H200, 2026-12-07, B=128 L=4096 H=128: 404 us (Triton's rows form 690, FlashMLA 224).

Needs Triton's Gluon (``triton.experimental.gluon``, Triton >= 3.5); :data:`AVAILABLE` says
whether it imported. There is no CPU interpreter for Gluon: on CPU the rows form runs instead.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # A CTA-wide barrier: gl.thread_barrier in Triton 3.5-3.6, gl.barrier from 3.7 on.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # A TMA load into shared memory: tma.async_copy_global_to_shared, renamed async_load later.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.constexpr_function
    def shared_layout(cols):
        """The NVMMA shared layout of a [64, cols] bf16 tile (the widest swizzle its rows take):
        what TMA writes and wgmma reads."""
        return gl.NVMMASharedLayout.get_default_for([BLOCK_N, cols], gl.bfloat16)

    @gluon.constexpr_function
    def score_layout():
        """S [64 rows, 64 keys], a wgmma result: 4 warps down the rows, the two warp groups side
        by side (each 32 of the keys)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])

    @gluon.constexpr_function
    def acc_layout(cols):
        """The accumulator [64 rows, cols]: as S, the warp groups each cols / 2 of the columns."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, cols // 2, 16])

    @gluon.constexpr_function
    def gather_layout(cols):
        """Registers of a [rows, cols] bf16 tile loaded from rows of memory: 16 bytes a thread, a
        warp across 256 columns (or 4 rows of 64), so 32 rows x 512 or x 64 is split over 8 warps
        with nothing loaded twice."""
        tpw = [1, 32] if cols >= 256 else [256 // cols, cols // 8]
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=tpw, warps_per_cta=[NUM_WARPS, 1],
                                order=[1, 0])

    @gluon.constexpr_function
    def warpgroup_tile_layout(cols):
        """Registers of a [rows, cols] 16-bit tile on one warp group (the warp-specialized forms'
        partitions): 16 bytes a thread, a warp across a row of up to 256 columns."""
        tpw = [1, 32] if cols >= 256 else [256 // cols, cols // 8]
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=tpw, warps_per_cta=[4, 1], order=[1, 0])
    AVAILABLE = True
except (ImportError, AttributeError):  # an older Triton: the launcher never picks this form
    AVAILABLE = False

BLOCK_H = 64  # query rows a program: one wgmma M
BLOCK_N = 64  # keys a block: one TMA box of rows
NUM_WARPS = 8  # two warp groups
SHARED_LIMIT = 232448  # bytes of shared memory one CTA may take on sm_90 (227 KB)


def shared_bytes(latent: int, rope: int, stages: int) -> int:
    """Shared memory the kernel takes: q, ``stages`` key blocks, P (bf16), and ~1 KB the compiler
    adds for its cross-warp reductions (seen: 229904 B at L=512, R=64, 2 stages)."""
    return 2 * (BLOCK_H * (latent + rope) + stages * BLOCK_N * (latent + rope) + BLOCK_H * BLOCK_N) + 1024


def check_stages(op: str, stages: int, latent: int, rope: int) -> None:
    """A ValueError naming ``op`` unless 1 <= stages and their key blocks fit an SM's shared
    memory beside q and P (the dense and the sparse kernels hold the same buffers)."""
    need = shared_bytes(latent, rope, stages)
    if stages < 1 or need > SHARED_LIMIT:
        raise ValueError(f"{op} config: FORM 'wgmma' needs num_stages >= 1 within {SHARED_LIMIT} B of shared "
                         f"memory, got {stages} ({need} B at kv_lora_rank {latent})")


def why_not(q_nope, kv_cache, layout: str, latent: int, rope: int) -> str | None:
    """Why a Gluon kernel here (this one or :mod:`.sparse_wgmma`) cannot run a call (None: as far
    as what they share goes, it can): Gluon present, a Hopper GPU, bf16 queries and cache,
    DeepSeek's widths."""
    import torch

    if not AVAILABLE:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if q_nope.device.type != "cuda" or torch.cuda.get_device_capability(q_nope.device) != (9, 0):
        return "it needs a Hopper GPU (sm_90: warp-group MMA)"
    if layout != "bf16" or q_nope.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return f"it reads bf16 caches with bf16 queries, got layout {layout!r}, q {q_nope.dtype}"
    if not shapes_supported(latent, rope):
        return f"kv_lora_rank {latent} / rope dim {rope}: it runs DeepSeek's 512 / 64"
    return None


def shapes_supported(latent: int, rope: int) -> bool:
    """Widths this kernel runs: DeepSeek's L=512, R=64, the ones checked on a GPU. (The code is
    written for L a power of two in 64..512, so the accumulator's L/2 columns are one wgmma
    N <= 256, and R in 16..64; other widths build for sm_90 but have not run.)"""
    return (latent, rope) == (512, 64)


if AVAILABLE:

    @gluon.jit
    def _split_wgmma_kernel(
        q_nope, q_pe, cache, lat_desc, pe_desc, block_table, seq_lens, out, lse,
        qk_scale,  # softmax_scale * log2(e)
        stride_qn_b, stride_qn_s, stride_qn_h, stride_qp_b, stride_qp_s, stride_qp_h,
        stride_c_page, stride_c_tok, stride_bt_b, stride_bt_p, stride_sl,
        stride_o_b, stride_o_split, stride_o_row, stride_lse_b, stride_lse_split,
        MAX_LEN,
        S_Q: gl.constexpr, H: gl.constexpr, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        MAX_SPLITS: gl.constexpr, DIRECT: gl.constexpr, STAGES: gl.constexpr,
        OVERLAP: gl.constexpr = False,  # block j+1's scores issued before block j's P @ kv has finished
    ):
        BH: gl.constexpr = 64
        BN: gl.constexpr = 64
        GN: gl.constexpr = 32

        S_L: gl.constexpr = score_layout()
        O_L: gl.constexpr = acc_layout(L)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        P_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        row_block, split, b, seq_len, lo, hi, n_blocks, bt_row = split_run(seq_lens, block_table, stride_sl,
                                                                           stride_bt_b, MAX_LEN, MAX_SPLITS)
        n_full = gl.maximum(hi - lo, 0) // BN

        # Queries -> shared memory (row r: query r // H, head r % H; rows past S_Q * H are zeros).
        rows_l = row_block * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, gather_layout(L)))
        rows_r = row_block * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, gather_layout(R)))
        q_lat = gl.allocate_shared_memory(gl.bfloat16, [BH, L], lat_desc.layout)
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BH, R], pe_desc.layout)
        _rows_to_shared(q_nope + b * stride_qn_b + (rows_l // H) * stride_qn_s + (rows_l % H) * stride_qn_h,
                        rows_l < S_Q * H, q_lat, L)
        _rows_to_shared(q_pe + b * stride_qp_b + (rows_r // H) * stride_qp_s + (rows_r % H) * stride_qp_h,
                        rows_r < S_Q * H, q_rope, R)

        k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, L], lat_desc.layout)
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, R], pe_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], P_SL)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        _cta_barrier()

        # Whole blocks in flight before the loop.
        for i in gl.static_range(STAGES):
            if i < n_full:
                _issue_block(lat_desc, pe_desc, bt_row, stride_bt_p, lo + i * BN, ready.index(i), k_lat.index(i),
                             k_rope.index(i), L, PAGE)

        rows_s = row_block * BH + gl.arange(0, BH, layout=ROW_S)
        limit = seq_len - S_Q + rows_s // H  # each row's causal limit
        keys_s = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
        m_i, l_i, acc, s_zero = _softmax_start(L)
        if OVERLAP:
            # Block 0's scores in flight before the loop (with no block at all they read stage 0's
            # stale bytes, and are waited for and dropped).
            if n_blocks > 0:
                _block_ready(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, lo, hi, 0, n_full, ready,
                             k_lat, k_rope, L, R, PAGE, GN, BN, STAGES)
            s_next = _scores(q_lat, q_rope, k_lat.index(0), k_rope.index(0), s_zero)
        for j in range(0, n_blocks):
            stage = j % STAGES
            start = lo + j * BN
            page = gl.load(bt_row + (start // PAGE) * stride_bt_p)  # a block lies in one page
            if OVERLAP:
                pos = start + keys_s
                visible = (pos[None, :] <= limit[:, None]) & (pos < hi)[None, :] & (page >= 0)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
                m_i, l_i, alpha, p = _softmax_step(s, visible, qk_scale, m_i, l_i)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                _cta_barrier()  # all of P written before either warp group reads it
                acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
                pv = warpgroup_mma(p_smem, k_lat.index(stage), acc, is_async=True)
                if j + 1 < n_blocks:
                    # The next block's two score products queue behind this P @ kv, so the tensor
                    # cores go from one to the next without waiting for this thread's softmax.
                    _block_ready(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, lo, hi, j + 1, n_full,
                                 ready, k_lat, k_rope, L, R, PAGE, GN, BN, STAGES)
                    s_next = _scores(q_lat, q_rope, k_lat.index((j + 1) % STAGES), k_rope.index((j + 1) % STAGES),
                                     s_zero)
                    acc = warpgroup_mma_wait(num_outstanding=2, deps=(pv,))  # P @ kv done, scores may run
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                _cta_barrier()  # both warp groups done with P and this stage: refill it
            else:
                _block_ready(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, lo, hi, j, n_full, ready,
                             k_lat, k_rope, L, R, PAGE, GN, BN, STAGES)
                pos = start + keys_s
                visible = (pos[None, :] <= limit[:, None]) & (pos < hi)[None, :] & (page >= 0)
                m_i, l_i, acc = _attend_block(q_lat, q_rope, k_lat.index(stage), k_rope.index(stage), p_smem,
                                              s_zero, visible, qk_scale, m_i, l_i, acc, ROW_O)
            if j + STAGES < n_full:
                _issue_block(lat_desc, pe_desc, bt_row, stride_bt_p, start + STAGES * BN, ready.index(stage),
                             k_lat.index(stage), k_rope.index(stage), L, PAGE)
        if OVERLAP:
            if n_blocks == 0:
                dropped = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))  # the prologue's, unused  # noqa: F841

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        o, row_lse = _softmax_end(m_i, l_i, acc)
        rows_o = row_block * BH + gl.arange(0, BH, layout=ROW_O)
        cols_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
        o_ptrs = out + b * stride_o_b + split * stride_o_split + rows_o[:, None] * stride_o_row + cols_o[None, :]
        row_ok = rows_o < S_Q * H
        if DIRECT:
            gl.store(o_ptrs, o.to(out.dtype.element_ty), mask=row_ok[:, None])
        else:  # an empty split leaves its partial out unwritten: the combine never reads it
            gl.store(o_ptrs, o, mask=(row_ok & (lo < hi))[:, None])
        gl.store(lse + b * stride_lse_b + split * stride_lse_split + rows_s, row_lse, mask=rows_s < S_Q * H)

    @gluon.jit
    def split_run(seq_lens, block_table, stride_sl, stride_bt_b, MAX_LEN, MAX_SPLITS: gl.constexpr):
        """This program of a decode grid (row block, split, request): (row_block, split, b,
        request b's length, this split's keys [lo, hi), its 64-key blocks, b's block-table row),
        the request's blocks cut into MAX_SPLITS equal runs (lo >= hi: an empty split). Every
        Gluon decode form cuts them so (the combine reads what they write)."""
        BN: gl.constexpr = 64
        row_block = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        seq_len = gl.load(seq_lens + b * stride_sl)
        kv_len = gl.minimum(gl.maximum(seq_len, 0), MAX_LEN)
        per_split = ((kv_len + BN - 1) // BN + MAX_SPLITS - 1) // MAX_SPLITS * BN
        lo = split * per_split
        hi = gl.minimum(lo + per_split, kv_len)
        n_blocks = gl.maximum(hi - lo + BN - 1, 0) // BN
        return row_block, split, b, seq_len, lo, hi, n_blocks, block_table + b * stride_bt_b

    @gluon.jit
    def q_rows_to_shared(base, stride_s, stride_h, row0, n_rows, H: gl.constexpr, buf, COLS: gl.constexpr):
        """For the warp-group partitions: rows row0.. of q (row r at base + (r // H) stride_s +
        (r % H) stride_h; past n_rows: zeros), their first COLS values -> buf [rows, COLS]."""
        layout: gl.constexpr = warpgroup_tile_layout(COLS)
        rows = row0 + gl.arange(0, buf.type.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        ptrs = base + (rows // H) * stride_s + (rows % H) * stride_h
        x = gl.load(ptrs[:, None] + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
        buf.store(x.to(buf.dtype))

    @gluon.jit
    def zero_rows_from(buf, valid):
        """For the warp-group partitions: rows ``valid``.. of a [64, cols] key buffer -> 0 (a
        split's partial last block: stale rows of its page, which a zero weight times would turn
        into NaN), made visible to this warp group's tensor cores."""
        cols: gl.constexpr = buf.type.shape[1]
        for r in gl.static_range(4):
            sub = buf.slice(r * 16, 16, dim=0)
            x = sub.load(warpgroup_tile_layout(cols))
            rows = r * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, warpgroup_tile_layout(cols)))
            sub.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _softmax_start(L: gl.constexpr):
        """The online softmax's state before any key: (m [64] = -inf, l [64] = 0, acc [64, L] = 0)
        and a zero S [64, 64] (the scores' first product starts from it)."""
        BH: gl.constexpr = 64
        BN: gl.constexpr = 64
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, score_layout()))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, score_layout()))
        acc = gl.zeros([BH, L], gl.float32, layout=acc_layout(L))
        return m_i, l_i, acc, gl.zeros([BH, BN], gl.float32, layout=score_layout())

    @gluon.jit
    def _softmax_end(m_i, l_i, acc):
        """(out = acc / l [64, L], lse [64] in natural log); a row that saw no key: out 0, lse -inf."""
        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        lse = gl.where(has_key, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        return acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, acc.type.layout))[:, None], lse

    @gluon.jit
    def _block_ready(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, lo, hi, j, n_full, ready, k_lat, k_rope,
                     L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, GN: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr):
        """Block j of the split in its stage, for every warp: a whole block's copy awaited, the
        partial last block gathered (zeros past ``hi``)."""
        stage = j % STAGES
        if j < n_full:
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        else:
            _gather_block(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, lo + j * BN, hi,
                          k_lat.index(stage), k_rope.index(stage), L, R, PAGE, GN, BN)
            fence_async_shared()
            _cta_barrier()

    @gluon.jit
    def _scores(q_lat, q_rope, kl, kr, s_zero):
        """S = q_lat @ kl^T + q_rope @ kr^T [64, 64], issued (two wgmma groups), not awaited."""
        s = warpgroup_mma(q_lat, kl.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _softmax_step(s, visible, qk_scale, m_i, l_i):
        """Scores S [64, 64] of a block into the online softmax (base 2): (m, l, alpha: the old
        accumulator's factor, p = exp2(S - m))."""
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        return m_new, l_i * alpha + gl.sum(p, axis=1), alpha, p

    @gluon.jit
    def _attend_block(q_lat, q_rope, kl, kr, p_smem, s_zero, visible, qk_scale, m_i, l_i, acc, ROW_O: gl.constexpr):
        """One block of 64 keys (kl [64, L], kr [64, R] in shared memory) into the online softmax
        (base 2) of 64 rows: S in the layout of s_zero (the warp groups split the keys), P
        through p_smem, acc [64, L] (the warp groups split the columns). ``visible`` [64, 64]
        masks scores; masked keys must be finite in shared memory (0 weight x NaN is NaN).
        Returns (m, l, acc); on return both warp groups are done with kl, kr and p_smem."""
        s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_lat, q_rope, kl, kr, s_zero),))
        m_new, l_i, alpha, p = _softmax_step(s, visible, qk_scale, m_i, l_i)

        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # all of P written before either warp group reads it
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        acc = warpgroup_mma(p_smem, kl, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()  # both warp groups done with P and these keys: the caller may refill them
        return m_new, l_i, acc

    @gluon.jit
    def _issue_block(lat_desc, pe_desc, bt_row, stride_bt_p, start, bar, lat_buf, rope_buf, L: gl.constexpr,
                     PAGE: gl.constexpr):
        """Keys start..start+64 (one page's rows) -> lat_buf, rope_buf through the copy engine;
        ``bar`` counts the bytes in. A -1 page gives a negative row: zeros."""
        page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
        row0 = page * PAGE + start % PAGE
        mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        _tma_load(lat_desc, [row0, 0], bar, lat_buf)
        _tma_load(pe_desc, [row0, L], bar, rope_buf)

    @gluon.jit
    def _rows_to_shared(row_ptrs, ok, buf, COLS: gl.constexpr):
        """row_ptrs [n] (layout: rows of gather_layout(COLS)) -> buf [n, COLS] in shared memory,
        each row's first COLS values; rows not ``ok`` are zeros."""
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, gather_layout(COLS)))
        x = gl.load(row_ptrs[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        buf.store(x.to(gl.bfloat16))

    @gluon.jit
    def _gather_block(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, start, hi, lat_buf, rope_buf,
                      L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, GN: gl.constexpr, BN: gl.constexpr):
        """The split's last, partial block -> lat_buf, rope_buf with masked loads, GN keys at a
        time: keys past ``hi`` or on a -1 page are zeros."""
        for c in gl.static_range(BN // GN):
            _gather_rows(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, start + c * GN, hi,
                         lat_buf.slice(c * GN, GN, dim=0), 0, L, PAGE, GN)
            _gather_rows(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, start + c * GN, hi,
                         rope_buf.slice(c * GN, GN, dim=0), L, R, PAGE, GN)

    @gluon.jit
    def _gather_rows(cache, bt_row, stride_bt_p, stride_c_page, stride_c_tok, start, hi, buf, COL0: gl.constexpr,
                     COLS: gl.constexpr, PAGE: gl.constexpr, GN: gl.constexpr):
        """Columns COL0..COL0+COLS of the cache rows of keys start..start+GN -> buf [GN, COLS];
        keys past ``hi`` or on a -1 page are zeros."""
        pos = start + gl.arange(0, GN, layout=gl.SliceLayout(1, gather_layout(COLS)))
        in_run = pos < hi
        page = gl.load(bt_row + (pos // PAGE) * stride_bt_p, mask=in_run, other=-1)
        rows = cache + page.to(gl.int64) * stride_c_page + (pos % PAGE) * stride_c_tok + COL0
        _rows_to_shared(rows, in_run & (page >= 0), buf, COLS)


def cache_descriptors(kv_cache, latent: int, rope: int):
    """(latent, rope) Gluon tensor descriptors over a bf16 cache's rows [pages * page_size, W],
    boxes of 64 rows (the caller checked page_size % 64 == 0 and back-to-back pages)."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    lat_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent], gl.bfloat16)
    pe_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl.bfloat16)
    return (TensorDescriptor.from_tensor(rows, [BLOCK_N, latent], lat_layout),
            TensorDescriptor.from_tensor(rows, [BLOCK_N, rope], pe_layout))


def compile_for_sm90(s_q: int = 1, heads: int = 128, splits: int = 2, stages: int = 2, latent: int = 512,
                     rope: int = 64, page: int = 64, overlap: bool = False):
    """The kernel built for sm_90 without a GPU (Triton's compiler and ptxas only): the compiled
    kernel (``.asm["ptx"]``, ``.metadata.shared``, ...). Pointers and strides are marked
    16-divisible, as the JIT specialises them at a launch. Not under TRITON_INTERPRET: there the
    reductions Gluon calls are interpreter functions it cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _split_wgmma_kernel
    lat = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent], gl.bfloat16))
    pe = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl.bfloat16))
    types = {"q_nope": "*bf16", "q_pe": "*bf16", "cache": "*bf16", "block_table": "*i32", "seq_lens": "*i32",
             "out": "*fp32" if splits > 1 else "*bf16", "lse": "*fp32", "qk_scale": "fp32",
             "lat_desc": f"tensordesc<bf16[{BLOCK_N},{latent}],{lat}>", "pe_desc": f"tensordesc<bf16[{BLOCK_N},{rope}],{pe}>"}
    consts = dict(S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page, MAX_SPLITS=splits, DIRECT=splits == 1,
                  STAGES=stages, OVERLAP=overlap)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # the block table's and seq_lens' strides are 1 and stay unmarked
    div16 = [n for n, t in signature.items()
             if t.startswith("*") or n == "MAX_LEN" or n.startswith(("stride_q", "stride_c", "stride_o", "stride_lse"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})
