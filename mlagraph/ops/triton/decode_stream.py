"""Gluon ``mla_decode`` for the memory-bound row counts on Hopper (sm_90): the keys-major form
(:mod:`.decode_keys`) with a loader warp of its own, opt-in (``config={"FORM": "keys", "TMA":
True, "WS": True}``) until the device says it beats the Triton keys form.

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
"""

from __future__ import annotations

from . import decode_wgmma

AVAILABLE = decode_wgmma.AVAILABLE
BLOCK_N = 64  # keys a block: one wgmma M
NUM_WARPS = 4  # the compute warp group; the loader is one more warp
STAGES = 2  # key slots (a third does not fit beside q at L=512)


def shared_bytes(rows: int, latent: int, rope: int) -> int:
    """Shared memory the kernel takes (``rows`` = its N, 16 or 32), with 1 KB for the compiler's
    cross-warp reductions."""
    return 2 * (STAGES * BLOCK_N * (latent + rope) + rows * (latent + rope) + BLOCK_N * rows) + 1024


if AVAILABLE:
    from .decode_wgmma import _cta_barrier, _tma_load, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, \
        warpgroup_mma_wait

    @gluon.constexpr_function
    def _acc_layout(n):
        """A keys-major product's result [M, n] on 4 warps: each warp 16 of every 64 rows of M."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.constexpr_function
    def _rows_layout(cols):
        """Registers of a [rows, cols] bf16 tile read by 4 warps, 16 bytes a thread."""
        tpw = [1, 32] if cols >= 256 else [256 // cols, cols // 8]
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=tpw, warps_per_cta=[4, 1], order=[1, 0])

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
        row_block = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)

        # This split's keys [lo, hi), as the other forms cut them.
        seq_len = gl.load(seq_lens + b * stride_sl)
        kv_len = gl.minimum(gl.maximum(seq_len, 0), MAX_LEN)
        per_split = ((kv_len + BN - 1) // BN + MAX_SPLITS - 1) // MAX_SPLITS * BN
        lo = split * per_split
        hi = gl.minimum(lo + per_split, kv_len)
        n_blocks = gl.maximum(hi - lo + BN - 1, 0) // BN
        bt_row = block_table + b * stride_bt_b
        row0 = row_block * BLOCK_H  # row r: query r // H, head r % H

        # q -> shared memory, [BLOCK_H, L] and [BLOCK_H, R] (the products' B side, transposed views).
        q_lat = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, L],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], gl.bfloat16))
        q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16))
        _q_rows_to_shared(q_nope + b * stride_qn_b, stride_qn_s, stride_qn_h, row0, S_Q * H, H, q_lat, L)
        _q_rows_to_shared(q_pe + b * stride_qp_b, stride_qp_s, stride_qp_h, row0, S_Q * H, H, q_rope, R)
        k_lat = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, L], lat_desc.layout)
        k_rope = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, R], pe_desc.layout)
        p_t = gl.allocate_shared_memory(gl.bfloat16, [BN, BLOCK_H],
                                        gl.NVMMASharedLayout.get_default_for([BN, BLOCK_H], gl.bfloat16))
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
        fence_async_shared()
        _cta_barrier()

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
    def _q_rows_to_shared(base, stride_s, stride_h, row0, n_rows, H: gl.constexpr, buf, COLS: gl.constexpr):
        """Rows row0.. of q (row r at base + (r // H) stride_s + (r % H) stride_h; past n_rows:
        zeros), their first COLS values -> buf [BLOCK_H, COLS]."""
        layout: gl.constexpr = _rows_layout(COLS)
        rows = row0 + gl.arange(0, buf.type.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        ptrs = base + (rows // H) * stride_s + (rows % H) * stride_h
        x = gl.load(ptrs[:, None] + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)
        buf.store(x.to(gl.bfloat16))

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
        COL_O: gl.constexpr = gl.SliceLayout(0, S_L)
        rows = row0 + gl.arange(0, BLOCK_H, layout=COL_S)
        limit = limit_base + rows // H  # each row's causal limit
        keys = gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=COL_S)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=COL_S)
        acc_t = gl.zeros([L, BLOCK_H], gl.float32, layout=S_L)
        s_zero = gl.zeros([BN, BLOCK_H], gl.float32, layout=S_L)
        for j in range(0, n_blocks):
            slot = j % 2
            start = lo + j * BN
            kl = k_lat.index(slot)
            mbarrier.wait(ready.index(slot), (j // 2) & 1)
            if start + BN > hi:  # the split's partial last block: its stale rows -> 0
                _zero_rows(kl, hi - start)
            s_t = warpgroup_mma(kl, q_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t = warpgroup_mma(k_rope.index(slot), q_rope.permute((1, 0)), s_t, is_async=True)
            s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
            page = gl.load(bt_row + (start // PAGE) * stride_bt_p)
            pos = start + keys
            visible = (pos[:, None] <= limit[None, :]) & (pos < hi)[:, None] & (page >= 0)
            s_t = gl.where(visible, s_t * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s_t, axis=0))
            # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s_t - m_safe[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_t.store(p.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()  # all of pT written before the product reads it
            acc_t = acc_t * gl.convert_layout(alpha, COL_O)[None, :]
            acc_t = warpgroup_mma(kl.permute((1, 0)), p_t, acc_t, is_async=True)
            acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t,))
            _cta_barrier()  # every warp done with the slot and pT
            mbarrier.arrive(free.index(slot))

        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        o_t = acc_t * gl.convert_layout(1.0 / l_safe, COL_O)[None, :]
        cols = gl.arange(0, L, layout=gl.SliceLayout(1, S_L))
        ptrs = out_base + rows[None, :] * out_row_stride + cols[:, None]
        gl.store(ptrs, o_t.to(out_base.dtype.element_ty), mask=((rows < n_rows) & write_out)[None, :])
        row_lse = gl.where(has_key, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_base + rows, row_lse, mask=rows < n_rows)

    @gluon.jit
    def _zero_rows(buf, valid):
        """Rows ``valid``.. of a [64, cols] key slot -> 0, visible to the tensor cores."""
        cols: gl.constexpr = buf.type.shape[1]
        for r in gl.static_range(4):
            sub = buf.slice(r * 16, 16, dim=0)
            x = sub.load(_rows_layout(cols))
            rows = r * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, _rows_layout(cols)))
            sub.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        _cta_barrier()


def compile_for_sm90(s_q: int = 1, heads: int = 16, splits: int = 1, latent: int = 512, rope: int = 64,
                     page: int = 64):
    """The kernel built for sm_90 without a GPU (see :func:`.decode_wgmma.compile_for_sm90`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _stream_kernel
    lat = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent], gl.bfloat16))
    pe = repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl.bfloat16))
    types = {"q_nope": "*bf16", "q_pe": "*bf16", "cache": "*bf16", "block_table": "*i32", "seq_lens": "*i32",
             "out": "*fp32" if splits > 1 else "*bf16", "lse": "*fp32", "qk_scale": "fp32",
             "lat_desc": f"tensordesc<bf16[{BLOCK_N},{latent}],{lat}>", "pe_desc": f"tensordesc<bf16[{BLOCK_N},{rope}],{pe}>"}
    block_h = max(16, triton.next_power_of_2(s_q * heads))
    consts = dict(S_Q=s_q, H=heads, L=latent, R=rope, PAGE=page, BLOCK_H=block_h, MAX_SPLITS=splits,
                  DIRECT=splits == 1)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div16 = [n for n, t in signature.items()
             if t.startswith("*") or n == "MAX_LEN" or n.startswith(("stride_q", "stride_c", "stride_o", "stride_lse"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})
