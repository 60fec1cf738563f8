"""Gluon ``sparse_mla`` for Hopper (sm_90): bf16 caches, 64 heads a program.

Same math, masks and outputs as :mod:`.sparse` (read its docstring first), and the same block
step as the dense Gluon decode (:func:`.decode_wgmma._attend_block`: the two warp groups split a
block's 64 keys for the scores and the 512 output columns for P @ kv, so no multiply-add runs
twice). What differs is where the keys come from: a token's selected positions, each through the
block table to its own cache row, so a block of 64 keys is 64 scattered rows. Hopper's copy
engine cannot gather rows, so they arrive by asynchronous copies (cp.async, 16 bytes a thread),
STAGES - 1 blocks ahead of the one being scored; a -1 index, a position past the table or a -1
page is a masked copy, which writes zeros (never the cache's stale bytes), and its score is
masked out.

Grid: one program per (token, block of 64 heads), the head block fastest, so the two programs of
a token at H=128 run side by side and the second reads the rows from L2. Shared memory at L=512,
R=64, 2 stages: q 72 KB + 2 x 72 KB keys + 8 KB P = 224 KB, one program an SM.
"""

from __future__ import annotations

from . import decode_wgmma

AVAILABLE = decode_wgmma.AVAILABLE
BLOCK_H = decode_wgmma.BLOCK_H
NUM_WARPS = decode_wgmma.NUM_WARPS

if AVAILABLE:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .decode_wgmma import (_attend_block, _cta_barrier, _rows_to_shared, _softmax_end, _softmax_start, acc_layout,
                               fence_async_shared, gather_layout, gl, gluon, score_layout, shared_layout)

    # cp.async into shared memory: async_copy.async_copy_global_to_shared, renamed async_load later.
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def _sparse_wgmma_kernel(
        qn_ptr, qp_ptr, cache_ptr, topk_ptr, req_ptr, bt_ptr, out_ptr, lse_ptr,
        num_heads, num_reqs, topk, max_len, qk_scale,  # qk_scale: softmax_scale * log2(e)
        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cp, stride_cs, stride_kt, stride_bt,
        stride_ot, stride_oh, stride_lt,
        L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
    ):
        BH: gl.constexpr = 64
        BN: gl.constexpr = 64
        S_L: gl.constexpr = score_layout()
        O_L: gl.constexpr = acc_layout(L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)

        tok, head0, q_lat, q_rope = _token_queries(qn_ptr, qp_ptr, num_heads, stride_qnt, stride_qnh, stride_qpt,
                                                   stride_qph, L, R)
        k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, L], shared_layout(L))
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, R], shared_layout(R))
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], shared_layout(BN))

        bt_row, topk_row, n_blocks = token_keys(req_ptr, bt_ptr, topk_ptr, tok, num_reqs, topk, stride_bt, stride_kt)

        # STAGES - 1 blocks in flight before the loop, one commit group each (empty past the end).
        for i in gl.static_range(STAGES - 1):
            if i < n_blocks:
                _gather_async(cache_ptr, topk_row, bt_row, i * BN, topk, max_len, stride_cp, stride_cs,
                              k_lat.index(i), k_rope.index(i), L, R, PAGE, BN)
            async_copy.commit_group()

        keys_s = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
        m_i, l_i, acc, s_zero = _softmax_start(L)
        for j in range(0, n_blocks):
            # Refill the stage block j - 1 used (every warp finished with it in _attend_block).
            ahead = j + STAGES - 1
            if ahead < n_blocks:
                _gather_async(cache_ptr, topk_row, bt_row, ahead * BN, topk, max_len, stride_cp, stride_cs,
                              k_lat.index(ahead % STAGES), k_rope.index(ahead % STAGES), L, R, PAGE, BN)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # this thread's copies of block j have landed
            fence_async_shared()  # ... and are visible to the tensor cores' reads
            _cta_barrier()  # every thread's copies, not only this one's

            offs = j * BN + keys_s
            pos = gl.load(topk_row + offs, mask=offs < topk, other=-1)
            in_table = (pos >= 0) & (pos < max_len)
            page = gl.load(bt_row + pos // PAGE, mask=in_table, other=-1)
            visible = (in_table & (page >= 0))[None, :]
            stage = j % STAGES
            m_i, l_i, acc = _attend_block(q_lat, q_rope, k_lat.index(stage), k_rope.index(stage), p_smem, s_zero,
                                          visible, qk_scale, m_i, l_i, acc, ROW_O)
        async_copy.wait_group(0)

        _store_token(m_i, l_i, acc, out_ptr, lse_ptr, tok, head0, num_heads, stride_ot, stride_oh, stride_lt, L)

    @gluon.jit
    def token_program(num_heads):
        """(this program's token, its first head): one program per token and 64 heads, the head
        block fastest in the grid, so a token's programs at H=128 read its rows side by side."""
        head_blocks = (num_heads + 63) // 64
        pid = gl.program_id(0)
        return (pid // head_blocks).to(gl.int64), (pid % head_blocks) * 64

    @gluon.jit
    def _token_queries(qn_ptr, qp_ptr, num_heads, stride_qnt, stride_qnh, stride_qpt, stride_qph, L: gl.constexpr,
                       R: gl.constexpr):
        """This program's token and first head (the head block fastest in the grid), and its 64
        heads' q in shared memory: (tok, head0, q_lat [64, L], q_rope [64, R]); heads past the
        last are zeros."""
        BH: gl.constexpr = 64
        tok, head0 = token_program(num_heads)
        heads_l = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, gather_layout(L)))
        heads_r = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, gather_layout(R)))
        q_lat = gl.allocate_shared_memory(gl.bfloat16, [BH, L], shared_layout(L))
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BH, R], shared_layout(R))
        _rows_to_shared(qn_ptr + tok * stride_qnt + heads_l * stride_qnh, heads_l < num_heads, q_lat, L)
        _rows_to_shared(qp_ptr + tok * stride_qpt + heads_r * stride_qph, heads_r < num_heads, q_rope, R)
        return tok, head0, q_lat, q_rope

    @gluon.jit
    def token_keys(req_ptr, bt_ptr, topk_ptr, tok, num_reqs, topk, stride_bt, stride_kt):
        """(the token's request's block-table row, its selected keys' row, their 64-key blocks)."""
        req = gl.load(req_ptr + tok)
        req = gl.where(req < 0, req + num_reqs, req)  # as the reference's torch indexing reads it
        return bt_ptr + req.to(gl.int64) * stride_bt, topk_ptr + tok * stride_kt, (topk + 63) // 64

    @gluon.jit
    def _store_token(m_i, l_i, acc, out_ptr, lse_ptr, tok, head0, num_heads, stride_ot, stride_oh, stride_lt,
                     L: gl.constexpr):
        """The token's out (o / l) and lse for its 64 heads (heads past the last not written)."""
        O_L: gl.constexpr = acc_layout(L)
        o, lse = _softmax_end(m_i, l_i, acc)
        heads_o = head0 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        cols_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
        o_ptrs = out_ptr + tok * stride_ot + heads_o[:, None] * stride_oh + cols_o[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(heads_o < num_heads)[:, None])
        heads_s = head0 + gl.arange(0, 64, layout=gl.SliceLayout(1, score_layout()))
        gl.store(lse_ptr + tok * stride_lt + heads_s, lse, mask=heads_s < num_heads)

    @gluon.jit
    def _gather_async(cache_ptr, topk_row, bt_row, start, topk, max_len, stride_cp, stride_cs, lat_buf, rope_buf,
                      L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr):
        """Asynchronous copies of the rows of selected keys start..start+BN -> lat_buf [BN, L],
        rope_buf [BN, R], 32 keys at a time (registers for the addresses stay few)."""
        GN: gl.constexpr = 32
        for c in gl.static_range(BN // GN):
            copy_rows_async(cache_ptr, topk_row, bt_row, start + c * GN, topk, max_len, stride_cp, stride_cs,
                            lat_buf.slice(c * GN, GN, dim=0), 0, PAGE, gather_layout(L))
            copy_rows_async(cache_ptr, topk_row, bt_row, start + c * GN, topk, max_len, stride_cp, stride_cs,
                            rope_buf.slice(c * GN, GN, dim=0), L, PAGE, gather_layout(R))

    @gluon.jit
    def copy_rows_async(cache_ptr, topk_row, bt_row, start, topk, max_len, stride_cp, stride_cs, buf,
                        COL0: gl.constexpr, PAGE: gl.constexpr, layout: gl.constexpr):
        """The rows of selected keys start..start+GN, from COL0 (in the cache's elements) on, as
        buf's dtype -> buf [GN, COLS] by cp.async in ``layout``; a key with no row (-1 index, past
        the table, -1 page) is a masked copy: zeros."""
        GN: gl.constexpr = buf.shape[0]
        COLS: gl.constexpr = buf.shape[1]
        offs = start + gl.arange(0, GN, layout=gl.SliceLayout(1, layout))
        pos = gl.load(topk_row + offs, mask=offs < topk, other=-1)
        in_table = (pos >= 0) & (pos < max_len)
        page = gl.load(bt_row + pos // PAGE, mask=in_table, other=-1)
        rows = (cache_ptr + page.to(gl.int64) * stride_cp + (pos % PAGE) * stride_cs + COL0).to(
            gl.pointer_type(buf.dtype))
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        _cp_async(buf, rows[:, None] + cols[None, :], mask=(in_table & (page >= 0))[:, None])

    @gluon.jit
    def _sparse_ds_kernel(
        qn_ptr, qp_ptr, cache_ptr, topk_ptr, req_ptr, bt_ptr, out_ptr, lse_ptr,
        num_heads, num_reqs, topk, max_len, qk_scale,  # qk_scale: softmax_scale * log2(e)
        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cp, stride_cs, stride_kt, stride_bt,
        stride_ot, stride_oh, stride_lt,
        L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
    ):
        """The same for fp8_ds caches (L e4m3 | L/128 float32 scales | R bf16 a row; the cache's
        strides in bytes). Block j + 1's raw bytes are gathered (cp.async, zeros where masked)
        while block j is attended; at its turn every warp widens them into the one bf16 tile the
        block step reads (e4m3 x the row's group scale, rounded once to bf16), and the rope, bf16
        already, is copied straight into one of two tiles. Shared memory at L=512: q 72 KB + the
        bf16 tile 64 KB + 2 x 8 KB rope + 33 KB raw + 8 KB P = 193 KB."""
        BH: gl.constexpr = 64
        BN: gl.constexpr = 64
        G: gl.constexpr = L // 128
        S_L: gl.constexpr = score_layout()
        O_L: gl.constexpr = acc_layout(L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)

        tok, head0, q_lat, q_rope = _token_queries(qn_ptr, qp_ptr, num_heads, stride_qnt, stride_qnh, stride_qpt,
                                                   stride_qph, L, R)
        k_lat = gl.allocate_shared_memory(gl.bfloat16, [BN, L], shared_layout(L))
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], shared_layout(R))
        raw_lat = gl.allocate_shared_memory(gl.uint8, [BN, L], gl.NVMMASharedLayout.get_default_for([BN, L], gl.uint8))
        raw_sc = gl.allocate_shared_memory(gl.float32, [BN, G], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], shared_layout(BN))

        bt_row, topk_row, n_blocks = token_keys(req_ptr, bt_ptr, topk_ptr, tok, num_reqs, topk, stride_bt, stride_kt)

        if n_blocks > 0:
            _gather_ds_async(cache_ptr, topk_row, bt_row, 0, topk, max_len, stride_cp, stride_cs, raw_lat, raw_sc,
                             k_rope.index(0), L, R, PAGE)
        async_copy.commit_group()
        keys_s = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
        m_i, l_i, acc, s_zero = _softmax_start(L)
        for j in range(0, n_blocks):
            async_copy.wait_group(0)  # this thread's copies of block j have landed
            _cta_barrier()  # every thread's; and the block before is done with the bf16 tile
            _widen_ds(raw_lat, raw_sc, k_lat)
            fence_async_shared()  # the widened tile and the copied rope, for the tensor cores
            _cta_barrier()  # the whole tile, and every warp done reading the raw bytes
            if j + 1 < n_blocks:
                _gather_ds_async(cache_ptr, topk_row, bt_row, (j + 1) * BN, topk, max_len, stride_cp, stride_cs,
                                 raw_lat, raw_sc, k_rope.index((j + 1) % 2), L, R, PAGE)
            async_copy.commit_group()

            offs = j * BN + keys_s
            pos = gl.load(topk_row + offs, mask=offs < topk, other=-1)
            in_table = (pos >= 0) & (pos < max_len)
            page = gl.load(bt_row + pos // PAGE, mask=in_table, other=-1)
            visible = (in_table & (page >= 0))[None, :]
            m_i, l_i, acc = _attend_block(q_lat, q_rope, k_lat, k_rope.index(j % 2), p_smem, s_zero, visible,
                                          qk_scale, m_i, l_i, acc, ROW_O)
        async_copy.wait_group(0)

        _store_token(m_i, l_i, acc, out_ptr, lse_ptr, tok, head0, num_heads, stride_ot, stride_oh, stride_lt, L)

    @gluon.constexpr_function
    def _bytes_layout(rows, cols, vec):
        """Registers of a [rows, cols] tile on the 8 warps, ``vec`` elements (16 bytes or fewer)
        a thread along the row (rows past what the threads cover repeat)."""
        across = min(32, cols // vec)
        return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // across, across],
                                warps_per_cta=[NUM_WARPS, 1], order=[1, 0])

    @gluon.jit
    def _gather_ds_async(cache_ptr, topk_row, bt_row, start, topk, max_len, stride_cp, stride_cs, raw_lat, raw_sc,
                         rope_buf, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr):
        """The fp8_ds rows of selected keys start..start+63, asynchronously, 32 keys at a time:
        their e4m3 latent -> raw_lat [64, L] bytes, group scales -> raw_sc [64, L/128] float32,
        bf16 rope -> rope_buf [64, R]. A key with no row is a masked copy: zeros."""
        G: gl.constexpr = L // 128
        GN: gl.constexpr = 32
        for c in gl.static_range(64 // GN):
            s0 = start + c * GN
            # (cache bytes: the latent from byte 0, 16 a lane; the scales from L, 4 float32 a
            # row; the rope from L + 4 G, 8 bf16 a lane)
            copy_rows_async(cache_ptr, topk_row, bt_row, s0, topk, max_len, stride_cp, stride_cs,
                            raw_lat.slice(c * GN, GN, dim=0), 0, PAGE, _bytes_layout(GN, L, 16))
            copy_rows_async(cache_ptr, topk_row, bt_row, s0, topk, max_len, stride_cp, stride_cs,
                            raw_sc.slice(c * GN, GN, dim=0), L, PAGE, _bytes_layout(GN, G, G))
            copy_rows_async(cache_ptr, topk_row, bt_row, s0, topk, max_len, stride_cp, stride_cs,
                            rope_buf.slice(c * GN, GN, dim=0), L + 4 * G, PAGE, _bytes_layout(GN, R, 8))

    @gluon.jit
    def _widen_ds(raw_lat, raw_sc, k_lat):
        """raw_lat [64, L] e4m3 bytes x raw_sc [64, L/128] group scales -> k_lat [64, L] bf16, in
        [16, 128] pieces (8 bytes a thread)."""
        layout: gl.constexpr = _bytes_layout(16, 128, 8)
        G: gl.constexpr = raw_lat.shape[1] // 128
        for r in gl.static_range(4):
            for c in gl.static_range(G):
                x = raw_lat.slice(r * 16, 16, dim=0).slice(c * 128, 128, dim=1).load(layout)
                s = raw_sc.slice(r * 16, 16, dim=0).slice(c, 1, dim=1).load(layout)  # [16, 1]
                y = x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * s
                k_lat.slice(r * 16, 16, dim=0).slice(c * 128, 128, dim=1).store(y.to(gl.bfloat16))


def compile_for_sm90(stages: int = 2, latent: int = 512, rope: int = 64, page: int = 64):
    """The kernel built for sm_90 without a GPU (see :func:`.decode_wgmma.compile_for_sm90`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _sparse_wgmma_kernel
    types = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "cache_ptr": "*bf16", "topk_ptr": "*i32", "req_ptr": "*i32",
             "bt_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    consts = dict(L=latent, R=rope, PAGE=page, STAGES=stages)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div16 = [n for n, t in signature.items() if t.startswith("*")] + [
        "stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_cp", "stride_cs", "stride_ot", "stride_oh"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})


def compile_ds_for_sm90(latent: int = 512, rope: int = 64, page: int = 64):
    """The fp8_ds kernel built for sm_90 without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _sparse_ds_kernel
    types = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "cache_ptr": "*u8", "topk_ptr": "*i32", "req_ptr": "*i32",
             "bt_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    consts = dict(L=latent, R=rope, PAGE=page)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div16 = [n for n, t in signature.items() if t.startswith("*")] + [
        "stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_cp", "stride_cs", "stride_ot", "stride_oh"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})
