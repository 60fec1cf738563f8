"""Build mla_decode's Triton kernels, and the MoE's grouped GEMM, for sm_90 without a GPU and
report what the build holds.

    python benchmarks/sm90_build.py --form keys --tma --layout fp8 --block-n 32 --warps 8 --stages 4
    python benchmarks/sm90_build.py --form grouped --block-m 16 --block-n 32 --block-k 512 --stages 3
    python benchmarks/sm90_build.py --form grouped --layout fp8 --block-m 64 --block-n 128 --persistent 2
    python benchmarks/sm90_build.py --form indexer --block-n 64 --stages 5   # the op's fp8 decode config

Prints registers, stack frame (spills), shared memory, wgmma (HGMMA) and mma.sync (HMMA) counts,
copy-engine loads (UTMALDG), spill loads (LDL) from the cubin's SASS, and the number of copy
buffers the pipeliner allocated; ``--ttgir FILE`` writes the TTGIR, ``--sass FILE`` the SASS
without offsets (``PYTHONPATH`` at another checkout builds its kernels: diff the two files to
show a refactor left a kernel's code unchanged). It uses the Triton it
imports; the H200's is 3.6 (torch 2.11), CI's 3.9, and the two allocate registers differently
(a tile that spills in one may not in the other), so build with the device's:

    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36 python benchmarks/sm90_build.py --form keys --tma --block-n 64 --stages 2

Read the numbers as leads, and time on the device.
Arguments are specialised as the JIT does at a launch (pointers 16-byte aligned, strides and
MAX_LEN divisible by 16), so loads vectorize as they would there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

STRIDES_DIV16 = ["stride_qn_b", "stride_qn_s", "stride_qn_h", "stride_qp_b", "stride_qp_s", "stride_qp_h",
                 "stride_c_page", "stride_c_tok", "stride_o_b", "stride_o_split", "stride_o_row", "stride_lse_b",
                 "stride_lse_split", "MAX_LEN"]


def build_grouped(args):
    """The grouped GEMM (mlagraph/ops/triton/grouped_fp8.py) for bf16 experts as the sorted MoE
    path launches it at decode sizes: rows gathered by token (GATHER_K = top-k 6), bf16 out."""
    from mlagraph.ops.triton import grouped_fp8

    fn = grouped_fp8._grouped_persistent_kernel if args.persistent else grouped_fp8._grouped_fp8_kernel
    types = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*bf16", "s_ptr": "*fp32", "out_ptr": "*bf16",
             "tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32", "tile_row_end_ptr": "*i32", "order_ptr": "*i32"}
    if args.layout != "bf16":  # fp8 experts (W8A16), or with fp8 activations too (W8A8, --layout fp8_ds)
        types.update(w_ptr="*u8", x_ptr="*u8" if args.layout == "fp8_ds" else "*bf16")
    consts = dict(NUM_EXPERTS=64, BLOCK_M=args.block_m, BLOCK_N=args.block_n, BLOCK_K=args.block_k,
                  A_FP8=args.layout == "fp8_ds", PRECISION="tf32", UPCAST=False, W_FP8=args.layout != "bf16",
                  GATHER_K=6)
    if args.persistent:  # the schedule of V2-Lite at T=32 (76 M tiles); the program count is the grid's
        consts.update(COUNT_CHUNK=128)
    return _compile(fn, types, consts, ["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_om"], args)


def build_wgmma(args):
    """The Gluon decode kernel (mlagraph/ops/triton/decode_wgmma.py): bf16 cache, 64 rows a program."""
    from mlagraph.ops.triton import decode_wgmma

    return decode_wgmma.compile_for_sm90(args.s_q, args.heads, args.splits, args.stages, overlap=args.overlap)


def build_select(args):
    """The DSA indexer's selection kernel (mlagraph/ops/triton/indexer.py) as decode launches it
    for 32K-key rows and top-2048 (``--warps 16``): a row in registers (TILE), compacted in
    CHUNK-column steps, the winners sorted."""
    from mlagraph.ops.triton import indexer

    types = {"s_ptr": "*i32", "pos_ptr": "*i64", "out_ptr": "*i32", "tmp_ptr": "*i64"}
    consts = dict(TILE=32768, CHUNK=args.chunk, BLOCK_K=2048)
    return _compile(indexer._select_kernel, types, consts, ["ss_t", "so_t", "st_t"], args)


def build_seesaw(args):
    """The seesaw Gluon kernels (mlagraph/ops/triton/seesaw.py), dense decode or (``--layout
    sparse``) sparse: three partitions (the registers reported are the launch's cap; each
    partition resets its own)."""
    from mlagraph.ops.triton import seesaw

    if args.layout == "sparse":
        return seesaw.compile_sparse_for_sm90()
    return seesaw.compile_for_sm90(args.s_q, args.heads, args.splits)


def build_stream(args):
    """The keys form's Gluon twin (mlagraph/ops/triton/decode_stream.py): 16 or 32 rows, a loader warp."""
    from mlagraph.ops.triton import decode_stream

    return decode_stream.compile_for_sm90(args.s_q, args.heads, args.splits)


def build_sparse_wgmma(args):
    """The Gluon sparse MLA kernel (mlagraph/ops/triton/sparse_wgmma.py): bf16 cache, 64 heads a program."""
    from mlagraph.ops.triton import sparse_wgmma

    return sparse_wgmma.compile_for_sm90(args.stages)


def build_indexer(args):
    """The DSA indexer's scores kernel (mlagraph/ops/triton/indexer.py) as decode launches it on
    fp8 keys (132-byte rows, one token a program, 64 heads of 128): unit strides are constants,
    as the JIT specialises them."""
    from mlagraph.ops.triton import indexer

    fn = indexer._logits_kernel
    types = {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*u8", "req_ptr": "*i32", "pos_ptr": "*i64",
             "bt_ptr": "*i32", "out_ptr": "*fp32"}
    consts = dict(sq_d=1, sw_h=1, s_req=1, s_pos=1, sbt_p=1, sk_d=1, FP8=True, DOT_F32=False, INTERPRETED=False,
                  ALIGN=4, SCALE_F32=True, FP16_DOTS=not args.bf16_dots, BLOCK_T=1, BLOCK_H=64, BLOCK_D=128,
                  BLOCK_N=args.block_n, NUM_STAGES=args.stages, FILL=True, MIN_BLOCKS=4, PREFETCH=args.prefetch,
                  PAGED_BLOCKS=not args.per_key_pages, EVEN_D=not args.per_key_pages)
    return _compile(fn, types, consts, ["D", "page_size", "S", "W", "sq_t", "sq_h", "sw_t", "sbt_b", "so_t"], args)


def build(args):
    if args.form == "indexer":
        return build_indexer(args)
    if args.form == "select":
        return build_select(args)
    if args.form == "seesaw":
        return build_seesaw(args)
    if args.form == "stream":
        return build_stream(args)
    if args.form == "sparse-wgmma":
        return build_sparse_wgmma(args)
    if args.form == "grouped":
        return build_grouped(args)
    if args.form == "wgmma":
        return build_wgmma(args)
    from mlagraph.ops.triton import decode, decode_keys, decode_keys_fp8

    layout = {"bf16": 0, "fp8": 1, "fp8_ds": 2}[args.layout]
    cache = "*bf16" if layout == 0 else "*u8"
    types = {"q_nope": "*bf16", "q_pe": "*bf16", "cache": cache, "block_table": "*i32", "seq_lens": "*i32",
             "fp8_scale": "*fp32", "out": "*fp32", "lse": "*fp32", "qk_scale": "fp32"}
    consts = dict(S_Q=args.s_q, H=args.heads, L=512, R=64, PAGE=64, BL=512, BR=64, LAYOUT=layout,
                  BLOCK_H=args.block_h or min(64, max(16, triton.next_power_of_2(args.s_q * args.heads))), BLOCK_N=args.block_n,
                  MAX_SPLITS=args.splits, DIRECT=args.splits == 1, F32=False, FP16=layout != 0)
    if args.form == "rows":
        fn = decode._split_kernel
    else:
        # bf16: whole [n, 512] boxes (decode_keys); fp8 layouts: [n, 128] byte chunks (decode_keys_fp8)
        fn = decode_keys._split_keys_kernel if layout == 0 else decode_keys_fp8._split_keys_fp8_kernel
        consts["TMA"] = args.tma
        n = args.block_n
        types["lat_desc"] = ("tensordesc<bf16[%d,512]>" if layout == 0 else "tensordesc<u8[%d,128]>") % n
        types["pe_desc"] = f"tensordesc<{'bf16' if layout != 1 else 'u8'}[{n},64]>"
        if not args.tma:
            consts.update(lat_desc=None, pe_desc=None)
    return _compile(fn, types, consts, STRIDES_DIV16, args)


def _compile(fn, types: dict, consts: dict, ints_div16: list[str], args):
    """Builds ``fn`` for sm_90 with ``consts`` as constexprs, ``types`` for the pointers (other
    arguments i32), every pointer and the ``ints_div16`` arguments marked 16-divisible."""
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
    div16 = [n for n, t in signature.items() if t.startswith("*")] + ints_div16
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": args.warps, "num_stages": args.stages})


def _cuobjdump(kernel, *flags: str) -> list[str]:
    """cuobjdump's output for each flag (e.g. --dump-sass), over the kernel's cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return [subprocess.run([os.path.join(tools, "cuobjdump"), flag, f.name], capture_output=True, text=True).stdout
                for flag in flags]
    finally:
        os.unlink(f.name)


def sass_text(kernel) -> str:
    """The cubin's SASS, one instruction a line, without offsets: equal for equal code."""
    (sass,) = _cuobjdump(kernel, "--dump-sass")
    offset = re.compile(r"/\*[0-9a-f]{4}\*/")
    return "\n".join(offset.sub("", line).strip() for line in sass.splitlines() if offset.search(line))


def loop_lengths(sass: str) -> list[int]:
    """Instructions in each loop of the SASS (a backward branch's span), longest first: per
    iteration work, what bounds an issue-bound kernel."""
    spans = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*(?:@!?U?P\w+\s+)?BRA\b[^;]*?0x([0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at:
            spans.append((at - target) // 16 + 1)
    return sorted(spans, reverse=True)


def report(kernel) -> str:
    usage, sass = _cuobjdump(kernel, "--dump-resource-usage", "--dump-sass")
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    buffers = [int(m) for m in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", kernel.asm["ttgir"])]
    counts = {op: sass.count(op) for op in ("HGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDL")}
    return (f"registers {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'} B, shared "
            f"{kernel.metadata.shared} B, copy buffers {max(buffers) if buffers else 0}, "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
            + f", longest loops {loop_lengths(sass)[:3]} instructions")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=["rows", "keys", "grouped", "wgmma", "sparse-wgmma", "indexer", "select", "seesaw", "stream"], default="keys")
    p.add_argument("--tma", action="store_true", help="keys form: whole blocks through tensor descriptors")
    p.add_argument("--layout", choices=["bf16", "fp8", "fp8_ds", "sparse"], default="bf16",
                   help="the cache layout; seesaw: sparse builds its sparse kernel")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--s-q", type=int, default=1)
    p.add_argument("--block-n", type=int, default=32)
    p.add_argument("--block-h", type=int, default=None, help="query rows a program (default: as the op, <= 64)")
    p.add_argument("--block-m", type=int, default=16, help="grouped: rows a tile")
    p.add_argument("--block-k", type=int, default=128, help="grouped: K columns a step")
    p.add_argument("--persistent", type=int, default=0, help="grouped: the persistent kernel, programs an SM")
    p.add_argument("--overlap", action="store_true", help="wgmma: the next block's scores issued before P @ kv ends")
    p.add_argument("--prefetch", action="store_true", help="indexer: the explicit one-block prefetch")
    p.add_argument("--bf16-dots", action="store_true", help="indexer: e4m3 -> bf16 dots (fp16_dots=False)")
    p.add_argument("--per-key-pages", action="store_true", help="indexer: a page lookup per key, D masked")
    p.add_argument("--chunk", type=int, default=4096, help="select: columns a compaction step")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--splits", type=int, default=2)
    p.add_argument("--ttgir", default=None, help="write the TTGIR here")
    p.add_argument("--sass", default=None, help="write the SASS here, without addresses (diff two trees' builds)")
    args = p.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    kernel = build(args)
    if args.ttgir:
        with open(args.ttgir, "w") as f:
            f.write(kernel.asm["ttgir"])
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass_text(kernel))
    print(" ".join(sys.argv[1:]) or "(defaults)", "->", report(kernel))


if __name__ == "__main__":
    main()
