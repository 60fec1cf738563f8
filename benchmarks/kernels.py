"""Every MLA kernel of our triton and aiter backends, checked and timed next to peers in one run.

    python benchmarks/kernels.py --out DIR [--only decode,fused,...,flash] [--no-compile]

For each workload (DeepSeek-V3 dimensions, bf16, random inputs) every variant is first checked
against a float32 reference (relative error ||out - ref|| / ||ref||; a failed check is reported
and not timed), then timed with the median of ``triton.testing.do_bench``, or with CUDA events
over CUDA-graph replays for the launch-bound steps (rotating several input sets so the L2 cache
cannot flatter them). Variants:

- ``triton``: our kernel (torch.ops.mlagraph_triton.*); ``triton:<cfg>`` a config variant;
- ``aiter-backend``: our ``aiter`` backend's op (torch.ops.mlagraph_aiter.*: aiter's kernel behind
  our op contract, called with the arguments the model passes it; fused write and bf16 decode
  only); ``aiter-backend:<cfg>`` a decode config variant. A row with a note when amd-aiter is
  not installed;
- ``eager`` / ``inductor``: the reference op's plain PyTorch, eager and under torch.compile;
- ``aiter``: AMD aiter's Triton kernel as a peer, fed directly (the amd-aiter wheel; see
  benchmarks/aiter_peers.py);
- ``sdpa-cudnn`` / ``sdpa-flash`` / ``sdpa-efficient``: torch SDPA backends (dense prefill);
- ``grouped`` / ``grouped-fp8``: torch.ops.mlagraph.moe (tokens grouped by expert) with bf16 /
  fp8 experts, next to ``all-experts`` (its oracle, every expert on every token) at V3's MoE dims.

Each row gives the time, the rate (TFLOP/s or TB/s, whichever bounds the workload), for our
rows (``triton*`` and ``aiter-backend*``) the ratio to the best peer (>1: ours is faster), and
the % of the floor from ../shared/ANCHORS.md (690 TFLOP/s bf16 GEMM, 4.25 TB/s copy, measured
on the H200). The table is printed last; the rows go to DIR/kernels.json and a plot to
DIR/kernels.png (when matplotlib is installed; otherwise ``python benchmarks/plot_kernels.py
DIR/kernels.json`` draws it anywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aiter_peers  # noqa: E402  (aiter's Triton kernels behind our op signatures)
from mlagraph.ops import aiter as aiter_backend  # noqa: E402  (registers torch.ops.mlagraph_aiter)
from mlagraph.ops import layouts  # noqa: E402

PEAK_FLOPS = 690e12  # bf16 GEMM 8192^3 on this H200 (ANCHORS.md)
PEAK_BYTES = 4.25e12  # device-to-device copy (ANCHORS.md)
L, R, NOPE, V = 512, 64, 128, 128
SM_SCALE = 0.1352
OURS = torch.ops.mlagraph_triton
AITER = torch.ops.mlagraph_aiter  # our aiter backend's own ops (the rest of it falls back to OURS)
REF = torch.ops.mlagraph
AITER_OK, AITER_WHY = aiter_backend.available()
OUR_VARIANTS = ("triton", "aiter-backend", "grouped")  # row variants that are our ops; every other is a peer


@dataclasses.dataclass
class Row:
    workload: str
    variant: str
    time_us: float | None = None
    flops: float = 0.0
    bytes: float = 0.0
    error: float | None = None  # relative error against the float32 reference
    note: str = ""

    @property
    def floor_us(self) -> float:
        return max(self.flops / PEAK_FLOPS, self.bytes / PEAK_BYTES) * 1e6

    @property
    def compute_bound(self) -> bool:
        return self.flops / PEAK_FLOPS >= self.bytes / PEAK_BYTES

    def rate(self) -> str:
        if self.time_us is None:
            return ""
        if self.compute_bound:
            return f"{self.flops / self.time_us / 1e6:.0f} TFLOP/s"
        return f"{self.bytes / self.time_us / 1e6:.2f} TB/s"


# ---------------------------------------------------------------------------------------------
# timing and checking


def rel_err(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    return ((got[fin] - want[fin]).norm() / want[fin].norm().clamp_min(1e-30)).item()


def do_bench(fn) -> float:
    import triton.testing

    # A long warm-up: the first variant timed after an idle spell ran slow while clocks ramped.
    return triton.testing.do_bench(fn, warmup=150, rep=200, return_mode="median") * 1e3


def graph_bench(fns, replays: int = 50) -> float:
    """µs per call of fns[i]() (one per input set), timed over CUDA-graph replays of all of them."""
    from common import capture_graph

    g = capture_graph(fns, repeats=4)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (4 * len(fns)))
    times.sort()
    return times[len(times) // 2]


class Runner:
    """Runs variants of one workload: check, then time; records a Row either way."""

    def __init__(self, rows: list[Row], workload: str, flops: float, nbytes: float, tol: float):
        self.rows, self.workload, self.flops, self.bytes, self.tol = rows, workload, flops, nbytes, tol

    def peer(self, variant: str, make, check, **kw) -> None:
        """A peer whose setup may fail (aiter missing, contract mismatch): build it, then run."""
        try:
            fn = make()
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            self.rows.append(Row(self.workload, variant, flops=self.flops, bytes=self.bytes, note=msg))
            print(f"  {variant}: {msg}", flush=True)
            return
        if isinstance(fn, tuple):  # (fn, one fn per input set for CUDA-graph timing)
            fn, kw["graph_fns"] = fn
        self.run(variant, fn, check, **kw)

    def skip(self, variant: str, note: str) -> None:
        """A row that is not run, with the reason."""
        self.rows.append(Row(self.workload, variant, flops=self.flops, bytes=self.bytes, note=note))
        print(f"  {variant}: {note}", flush=True)

    def run(self, variant: str, fn, check, *, graph_fns=None, note: str = "") -> None:
        row = Row(self.workload, variant, flops=self.flops, bytes=self.bytes, note=note)
        self.rows.append(row)
        try:
            row.error = check(fn())
            if not row.error <= self.tol:
                row.note = (row.note + f" FAILED check (tol {self.tol:g})").strip()
                print(f"  {variant}: FAILED check, error {row.error:.3g}", flush=True)
                return
            row.time_us = graph_bench(graph_fns) if graph_fns else do_bench(fn)
            print(f"  {variant}: {row.time_us:.1f} us, error {row.error:.2e}", flush=True)
        except Exception as e:  # a peer that cannot run here is a row with a reason, not a crash
            row.note = (row.note + f" {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}").strip()
            print(f"  {variant}: {row.note}", flush=True)
            traceback.print_exc(limit=3)
        finally:
            torch.cuda.synchronize()


def kernels(module: str):
    """Our kernel module (its functions take a ``config=`` override the ops do not expose)."""
    import importlib

    return importlib.import_module(f"mlagraph.ops.triton.{module}")


def sweep(run, fn, check, configs, prefix: str = "triton", graphs: bool = False) -> None:
    """Config variants of our kernel: ``<prefix>:<key=value,...>`` rows (``graphs``: timed as
    CUDA-graph replays, for launch-bound sizes)."""
    for cfg in configs:
        call = lambda cfg=cfg: fn(config=cfg)  # noqa: E731
        run.run(f"{prefix}:" + ",".join(f"{k}={v}" for k, v in cfg.items()), call, check,
                **({"graph_fns": [call]} if graphs else {}))


def run_aiter_backend(run, fn, check, **kw) -> None:
    """The ``aiter-backend`` row: our aiter backend's op, or a row saying why it cannot run here."""
    if AITER_OK:
        run.run("aiter-backend", fn, check, **kw)
    else:
        run.skip("aiter-backend", f"skipped: {AITER_WHY}")


def inductor(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


# ---------------------------------------------------------------------------------------------
# inputs


def paged_cache(layout: str, seq_lens: list[int], page_size: int, g: torch.Generator, dev="cuda"):
    """(cache, scale, block_table [B, P] int32, seq_lens int32) with random latents written."""
    pages = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    scale = torch.tensor([0.05], device=dev) if layout == "fp8" else None
    width = layouts.latent_row_width(layout, L, R)
    cache = torch.empty(num_pages * page_size, width, dtype=layouts.latent_storage_dtype(layout, torch.bfloat16),
                        device=dev)
    chunk = 1 << 16  # quantize in chunks: a float32 copy of 600k rows would be large
    for i in range(0, cache.shape[0], chunk):
        n = min(chunk, cache.shape[0] - i)
        kv_c = torch.randn(n, L, device=dev, dtype=torch.bfloat16)
        k_pe = torch.randn(n, R, device=dev, dtype=torch.bfloat16)
        cache[i : i + n] = layouts.quantize_latent(layout, kv_c, k_pe, scale, cache.dtype)
    return (cache.view(num_pages, page_size, width), scale, table.to(dev),
            torch.tensor(seq_lens, dtype=torch.int32, device=dev))


ROW_BYTES = {"bf16": 1152, "fp8": 576, "fp8_ds": 656}


# ---------------------------------------------------------------------------------------------
# workloads


def bench_decode(rows, args, g):
    cases = [(128, 128, 4096, "bf16", 1), (128, 128, 1151, "bf16", 1), (16, 128, 4096, "bf16", 1),
             (16, 128, 4096, "fp8", 1), (16, 128, 4096, "fp8_ds", 1), (16, 64, 16384, "bf16", 1),
             (16, 128, 4096, "bf16", 2), (128, 128, 4096, "bf16", 2), (16, 1, 1024, "bf16", 1)]
    for h, b, ctx, layout, s_q in cases:
        name = f"mla_decode H={h} B={b} L={ctx} {layout}" + (f" s_q={s_q}" if s_q > 1 else "")
        print(name, flush=True)
        cache, scale, table, lens = paged_cache(layout, [ctx] * b, 64, g)
        q_nope = torch.randn(b, s_q, h, L, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(b, s_q, h, R, device="cuda", dtype=torch.bfloat16)
        flops = 2 * h * s_q * 1088 * b * ctx
        nbytes = ROW_BYTES[layout] * b * ctx + q_nope.numel() * 2 * 2 + q_pe.numel() * 2
        args_ = (q_nope, q_pe, cache, table, lens, scale, layout, SM_SCALE)
        want = REF.mla_decode(*args_)[0]
        check = lambda out: rel_err(out[0], want)  # noqa: E731
        run = Runner(rows, name, flops, nbytes, tol=2e-2)
        # Our rows are timed as CUDA-graph replays, as the engine runs decode; "triton eager" adds
        # the op's host work (dispatch, checks, config, descriptors, launch). On an H100 on
        # 2026-12-07 the op took 365 us a call timed eagerly at H=16 B=128, where the flash
        # workload had timed its kernel config as replays at 216: the host was the bottleneck.
        ours = lambda: OURS.mla_decode(*args_)  # noqa: E731
        run.run("triton", ours, check, graph_fns=[ours])
        run.run("triton eager", ours, check)
        if args.sweep:
            dec = kernels("decode").mla_decode_with_config
            cfgs = DECODE_SWEEP.get((h, layout, s_q, b), DECODE_SWEEP.get((h, layout, s_q), []))
            sweep(run, lambda config: dec(*args_, config=config), check, cfgs, graphs=True)
        if args.new_forms and h * s_q <= 32:  # the keys form's Gluon twin (decode_stream), every layout
            dec = kernels("decode").mla_decode_with_config
            sweep(run, lambda config: dec(*args_, config=config), check,
                  [{"FORM": "keys", "TMA": True, "WS": True}, {"FORM": "keys", "TMA": True, "WS": True, "num_stages": 2}],
                  graphs=True)
        run.run("eager", lambda: REF.mla_decode(*args_), check)
        if s_q > 1:
            continue  # the peers below take one query token (the flash workload has FlashMLA / FlashInfer at s_q 2)
        if args.compile and (h, b, ctx, layout) in ((16, 128, 4096, "bf16"), (128, 128, 4096, "bf16")):
            ref_c = inductor(reference_body("decode", "mla_decode"))
            run.run("inductor", lambda: ref_c(*args_), check)
        if layout == "bf16":
            configs = AITER_DECODE_SWEEP[h] if args.sweep else []
            aiter_decode_rows(run, q_nope, q_pe, cache, table, lens, check, configs)
            run.peer("aiter", lambda: aiter_peers.decode_runner(q_nope, q_pe, cache, table, lens, SM_SCALE), check)


def aiter_decode_rows(run, q_nope, q_pe, cache, table, lens, check, configs=()) -> None:
    """``aiter-backend`` (and ``aiter-backend:<cfg>`` for each DecodeConfig field dict in
    ``configs``) rows of ``mla_decode``, layout "bf16", s_q = 1.

    The model hands this backend q concatenated (decode_q_split=False): the fused op's q
    [B, H, L + R], passed as the adjacent views q[..., :L] / q[..., L:], which the op reads in
    place. That q is built once here, outside the timing; the op builds aiter's metadata on the
    device in every call (part of its time). ``check(out)``: the workload's check of the op's
    (out, lse) against the reference, as for the other rows.
    """
    lat = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [B, 1, H, L + R]
    a = (q[..., :lat], q[..., lat:], cache, table, lens, None, "bf16", SM_SCALE)
    run_aiter_backend(run, lambda: AITER.mla_decode(*a), check)
    if AITER_OK and configs:  # kernels.mla_decode's config= override (the op has none)
        from mlagraph.ops.aiter import kernels as aiter_kernels

        sweep(run, lambda config: aiter_kernels.mla_decode(*a, config=aiter_kernels.DecodeConfig(**config)), check,
              configs, prefix="aiter-backend")


# Fields of mlagraph.ops.aiter.kernels.DecodeConfig, per head count; the default splits come
# from shapes (default_decode_config: 1 for H=128 B=128, 3 for H=16 B=128, 5 for H=16 B=64).
AITER_DECODE_SWEEP = {
    128: [{"num_kv_splits": 2}, {"num_kv_splits": 4}, {"block_n": 64}, {"block_n": 16}, {"num_warps": 8}],
    16: [{"num_kv_splits": 1}, {"num_kv_splits": 8}, {"block_n": 64}, {"block_n": 16}, {"num_stages": 2}],
}

# The keys-major form (decode_keys.py) at H=16: s_q or (s_q, batch) -> config overrides; the flash
# workload times them beside FlashMLA and FlashInfer (graphed).
_KT = {"FORM": "keys", "TMA": True}
KEYS_SWEEP = {
    1: [{**_KT, "BLOCK_N": 64, "num_warps": w, "num_stages": 2, "MAX_SPLITS": s} for w in (4, 8) for s in (1, 2, 4)]
       + [{**_KT, "BLOCK_N": 32, "num_warps": 4, "num_stages": st, "MAX_SPLITS": s} for st in (3, 4) for s in (2, 4)]
       + [{"FORM": "keys", "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "MAX_SPLITS": s} for s in (1, 2)]
       # the rows form, now that the keys form is the default here
       + [{"FORM": "rows"}],
    2: [{**_KT, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "MAX_SPLITS": s} for s in (1, 2, 4)]
       + [{**_KT, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "MAX_SPLITS": 2},
          {**_KT, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "MAX_SPLITS": 4}, {"FORM": "rows"}],
}

# The fp8 layouts' keys form (decode_keys_fp8.py): on the H100 (2026-12-07) 32 keys / 4 warps /
# 3 stages ran 273 / 307 us (fp8 / fp8_ds) beside the rows form's 270 / 330, and 64 keys 402-636
# (they spill); sm90_build.py finds no spill at 32 keys / 8 warps, and a single copy buffer in
# every TMA config (the copies are not pipelined), hence the gathered (cp.async) rows.
_FP8_KEYS = ([{**_KT, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "MAX_SPLITS": 2},
              {**_KT, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "MAX_SPLITS": 4}]
             + [{**_KT, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "MAX_SPLITS": s} for s in (1, 2)]
             + [{"FORM": "keys", "BLOCK_N": n, "num_warps": 8, "num_stages": st, "MAX_SPLITS": 2}
                for n, st in ((64, 2), (32, 3))])
DECODE_SWEEP = {  # (heads, layout, s_q[, batch]) -> config overrides (the rows-major form's
    # sweeps of 2026-11-29 and 12-04 are in the README and benchmarks/results/h200-2026-12-04/)
    (16, "fp8", 1): _FP8_KEYS,
    (16, "fp8_ds", 1): _FP8_KEYS,
    # batch 1 (V2-Lite-sized decode): how many splits pay for their combine
    (16, "bf16", 1, 1): [{"FORM": "rows"}, {"FORM": "rows", "MAX_SPLITS": 8}]
                        + [{**_KT, "BLOCK_N": 64, "num_warps": w, "num_stages": 2, "MAX_SPLITS": s}
                           for w in (4, 8) for s in (8, 32)],
    (16, "bf16", 1): [{**_KT, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "MAX_SPLITS": s} for s in (1, 2, 4)]
                     + [{"FORM": "rows"}],
}


def bench_fused(rows, args, g):
    """RoPE + concat + cache write at decode, as CUDA-graph replays over 4 input sets."""
    from mlagraph.ops.rope import rope_cos_sin_cache

    cos_sin = rope_cos_sin_cache(R, 8192, base=10000.0, device="cuda")
    for b, h in ((128, 128), (1, 128)):
        name = f"fused rope+cat+write decode B={b} H={h}"
        print(name, flush=True)
        sets = []
        for _ in range(4):
            cache = torch.randn(b + 64, 64, L + R, device="cuda").to(torch.bfloat16).view(-1, 64, L + R)
            sets.append(dict(
                q_nope=torch.randn(b, h, L, device="cuda", dtype=torch.bfloat16),
                q_pe=torch.randn(b, h, R, device="cuda", dtype=torch.bfloat16),
                kv_c=torch.randn(b, L, device="cuda", dtype=torch.bfloat16),
                k_pe=torch.randn(b, 1, R, device="cuda", dtype=torch.bfloat16),
                positions=torch.randint(0, 8192, (b,), device="cuda"),
                cos_sin_cache=cos_sin, kv_cache=cache,
                slot_mapping=torch.randperm(cache.shape[0] * 64, device="cuda")[:b],
                scale=None, layout="bf16", interleaved=True))
        s0 = sets[0]
        # q in + q out + kv_c + k_pe in + k_rot out + cache rows out (bf16)
        nbytes = 2 * (2 * b * h * (L + R) + b * L + 2 * b * R + b * (L + R))
        want_cache = s0["kv_cache"].clone()
        want_q, want_k = REF.fused_rope_concat_cache_write(**{**s0, "kv_cache": want_cache})
        slots = s0["slot_mapping"]

        def check(out, kv_cache=None):
            cache = (kv_cache if kv_cache is not None else s0["kv_cache"]).view(-1, L + R)
            return max(rel_err(out[0], want_q), rel_err(out[1], want_k),
                       rel_err(cache[slots], want_cache.view(-1, L + R)[slots]))

        run = Runner(rows, name, 0.0, nbytes, tol=1e-2)
        op = lambda fn: (lambda: fn(**s0), [lambda s=s: fn(**s) for s in sets])  # noqa: E731
        f, fs = op(OURS.fused_rope_concat_cache_write)
        run.run("triton", f, check, graph_fns=fs)
        if args.sweep and b > 1:
            mod = kernels("rope_cache").fused_rope_concat_cache_write
            for cfg in ({"block_h": 4}, {"block_h": 16}, {"block_h": 8, "num_warps": 8}, {"block_h": 8, "num_warps": 2}):
                f, fs = op(lambda cfg=cfg, **kw: mod(**kw, config={**mod_cfg(b, h), **cfg}))
                run.run("triton:" + ",".join(f"{k}={v}" for k, v in cfg.items()), f, check, graph_fns=fs)
        aiter_fused_row(run, sets, want_q, want_cache)
        f, fs = op(REF.fused_rope_concat_cache_write)
        run.run("eager", f, check, graph_fns=fs)
        if args.compile:
            body = inductor(reference_body("cache", "fused_rope_concat_cache_write"))
            f, fs = op(body)
            run.run("inductor", f, check, graph_fns=fs)
        run.peer("aiter", lambda: aiter_peers.fused_runner(sets), check_fused_aiter(check))
        # What the decode graph runs after concat elimination: q_nope stays where it is. (The
        # aiter backend has no such graph: its decode reads the fused op's concatenated q.)
        split = [{**s, "q_nope": s["q_nope"][..., :0]} for s in sets]
        nb = 2 * (2 * b * h * R + b * L + 2 * b * R + b * (L + R))
        run2 = Runner(rows, name + " (no concat)", 0.0, nb, tol=1e-2)
        run2.run("triton", lambda: OURS.fused_rope_concat_cache_write(**split[0]),
                 lambda out: rel_err(out[0], want_q[..., L:]),
                 graph_fns=[lambda s=s: OURS.fused_rope_concat_cache_write(**s) for s in split])


def aiter_fused_row(run, sets, want_q, want_cache) -> None:
    """The ``aiter-backend`` row of the fused RoPE + concat + cache write, as CUDA-graph
    replays over ``sets`` (dicts of the op's arguments, exactly as the model passes them).

    Its K output is an EMPTY [0] tensor (fused_returns_k=False: aiter writes the cache and
    hands no K on), so the check compares q and the cache rows of sets[0]'s slots only, against
    the reference's ``want_q`` [T, H, L + R] and ``want_cache`` (the reference's copy of
    sets[0]'s cache after its write), and raises if K is not that empty tensor.
    """
    s0 = sets[0]
    slots = s0["slot_mapping"][s0["slot_mapping"] >= 0]

    def check(out):
        if tuple(out[1].shape) != tuple(aiter_backend.EMPTY_K_SHAPE):
            raise ValueError(f"aiter-backend fused op: K: expected the empty {list(aiter_backend.EMPTY_K_SHAPE)} "
                             f"of fused_returns_k=False, got shape {list(out[1].shape)}")
        width = s0["kv_cache"].shape[-1]
        got, want = s0["kv_cache"].view(-1, width)[slots], want_cache.view(-1, width)[slots]
        return max(rel_err(out[0], want_q), rel_err(got, want))

    fn = AITER.fused_rope_concat_cache_write
    run_aiter_backend(run, lambda: fn(**s0), check, graph_fns=[lambda s=s: fn(**s) for s in sets])


def mod_cfg(b, h):
    return kernels("rope_cache").rope_cache_config(b, h, L, R, 2)


def check_fused_aiter(check):
    return lambda out: check(out[:2], out[2] if len(out) > 2 else None)


def _qkv(n, h, g, dqk=NOPE + R, dv=V):
    return (torch.randn(n, h, dqk, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, h, dqk, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, h, dv, device="cuda", dtype=torch.bfloat16))


def _causal_pairs(lens_q, lens_k):
    return sum(sum(min(lk, lk - lq + i + 1) for i in range(lq)) for lq, lk in zip(lens_q, lens_k))


def bench_prefill(rows, args, g):
    """Dense causal prefill, H=128, qk 192, v 128: one request (where SDPA applies), ragged, prefix."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h = 128
    cases = [("N=2048", [2048], [2048]), ("N=4096", [4096], [4096]), ("N=8192", [8192], [8192]),
             ("ragged 4x2048", [2048] * 4, [2048] * 4), ("ragged 1024..3072", [1024, 3072, 2048, 1536], None),
             ("prefix 2048 new on 6144 cached", [2048], [8192])]
    for label, lens_q, lens_k in cases:
        lens_k = lens_k or lens_q
        name = f"mha_prefill {label}"
        print(name, flush=True)
        q, _, _ = _qkv(sum(lens_q), h, g)
        _, k, v = _qkv(sum(lens_k), h, g)
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
        pairs = _causal_pairs(lens_q, lens_k)
        flops = 2 * h * (NOPE + R + V) * pairs
        nbytes = 2 * (q.numel() + k.numel() + v.numel() + q.shape[0] * h * V)
        # Checked on 8 heads (the reference materializes [H, T, S] scores).
        hs = slice(0, 8)
        want = REF.mha_prefill(q[:, hs].float(), k[:, hs].float(), v[:, hs].float(), cu_q, cu_k, SM_SCALE, True)[0]
        check = lambda out: rel_err(out[0][:, hs], want)  # noqa: E731
        run = Runner(rows, name, flops, nbytes, tol=2e-2)
        run.run("triton", lambda: OURS.mha_prefill(q, k, v, cu_q, cu_k, SM_SCALE, True), check)
        if args.sweep and label in ("N=8192", "ragged 4x2048"):
            pf = kernels("prefill")
            base = pf.prefill_config(q, v)
            sweep(run, lambda config: pf.mha_prefill(q, k, v, cu_q, cu_k, SM_SCALE, True, config={**base, **config}),
                  check, [{"BLOCK_N": 128, "num_stages": 2}, {"BLOCK_M": 64, "num_warps": 4}, {"num_stages": 2},
                          {"BLOCK_N": 32}])
        if len(lens_q) == 1 and lens_q == lens_k:
            from mlagraph.ops.triton import prefill as tp

            run.run("triton:sdpa-cudnn", lambda: tp.sdpa_prefill(q, k, v, SM_SCALE), check)
            qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
            v192 = F.pad(vt, (0, NOPE + R - V))

            def sdpa(backend, vv):
                def f():
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(qt, kt, vv, is_causal=True, scale=SM_SCALE)
                    return (o[0, :, :, :V].transpose(0, 1),)
                return f

            run.run("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, vt), check)
            run.run("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION, v192), check, note="v padded to 192")
            run.run("sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION, vt), check)


def bench_sparse(rows, args, g):
    """DSA sparse prefill: 4096 new tokens at the end of a 32K context, top-2048 keys each."""
    h, t, ctx, topk = 128, 4096, 32768, 2048
    name = f"sparse_mla s_q={t} L={ctx} topk={topk} H={h}"
    print(name, flush=True)
    cache, scale, table, _ = paged_cache("bf16", [ctx], 64, g)
    pos = torch.arange(ctx - t, ctx, device="cuda")
    # random distinct visible positions per token: top-k of random keys masked to <= pos
    noise = torch.rand(t, ctx, device="cuda").masked_fill(torch.arange(ctx, device="cuda")[None] > pos[:, None], -1)
    idx = noise.topk(topk, dim=1).indices.to(torch.int32)
    del noise
    q_nope = torch.randn(t, h, L, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(t, h, R, device="cuda", dtype=torch.bfloat16)
    req = torch.zeros(t, dtype=torch.int32, device="cuda")
    flops = 2 * h * 1088 * t * topk
    nbytes = 1152 * min(ctx, t * topk) + 2 * (q_nope.numel() * 2 + q_pe.numel()) + 4 * idx.numel()
    sub = slice(0, 64)  # checked on 64 tokens: the reference gathers [T, K, 576] float32
    want = REF.sparse_mla(q_nope[sub], q_pe[sub], cache, idx[sub], req[sub], table, scale, "bf16", SM_SCALE)[0]
    check = lambda out: rel_err(out[0][sub], want)  # noqa: E731
    run = Runner(rows, name, flops, nbytes, tol=2e-2)
    run.run("triton", lambda: OURS.sparse_mla(q_nope, q_pe, cache, idx, req, table, scale, "bf16", SM_SCALE), check)
    if args.sweep:
        sp = kernels("sparse")
        base = sp.sparse_config(q_nope)
        sweep(run, lambda config: sp.sparse_mla(q_nope, q_pe, cache, idx, req, table, scale, "bf16", SM_SCALE,
                                                config={**base, **config}),
              check, [{"BLOCK_N": 32, "num_stages": 2}, {"BLOCK_N": 64, "num_stages": 2}, {"BLOCK_N": 128, "num_stages": 1},
                      {"BLOCK_N": 64, "num_warps": 4}])
    run.peer("aiter", lambda: aiter_peers.sparse_runner(q_nope, q_pe, cache, idx, req, table, SM_SCALE), check)


def indexer_decode_case(b: int, ctx: int, hi: int = 64, d: int = 128, ps: int = 64):
    """(q, weights, k_cache, req_ids, positions, block_table) for b requests decoding one token
    each after ctx fp8 index keys (shuffled pages of ps)."""
    pages = ctx // ps
    k_cache = torch.empty(b * pages * ps, d + 4, dtype=torch.uint8, device="cuda")
    for i in range(0, k_cache.shape[0], 1 << 18):
        n = min(1 << 18, k_cache.shape[0] - i)
        k_cache[i : i + n] = layouts.quantize_index_keys("fp8", torch.randn(n, d, device="cuda"), torch.uint8)
    k_cache = k_cache.view(b * pages, ps, d + 4)
    table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
    q = torch.randn(b, hi, d, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(b, hi, device="cuda") * (d ** -0.5) * (hi ** -0.5)
    req = torch.arange(b, dtype=torch.int32, device="cuda")
    positions = torch.full((b,), ctx - 1, device="cuda")
    return q, w, k_cache, req, positions, table


def bench_indexer(rows, args, g):
    """DSA indexer at decode: 128 requests, one new token each, 32K cached fp8 keys, top 2048."""
    b, ctx, hi, d, topk = 128, 32768, 64, 128, 2048
    name = f"indexer_topk decode B={b} L={ctx} fp8"
    print(name, flush=True)
    q, w, k_cache, req, positions, table = indexer_decode_case(b, ctx, hi, d)
    args_ = (q, w, k_cache, req, positions, table, "fp8", topk)
    nbytes = b * ctx * (d + 4) + q.numel() * 2 + w.numel() * 4 + b * topk * 4
    flops = 2 * hi * d * b * ctx
    sub = slice(0, 8)  # the reference gathers every key of each token in float32
    ref_scores = _indexer_scores(q[sub], w[sub], k_cache, table[:8], ctx)

    def check(out):
        got = out[sub].long()
        if (got < 0).any() or any(r.unique().numel() != topk for r in got):  # visible and distinct
            return float("inf")
        picked = ref_scores.gather(1, got).sort(dim=1, descending=True).values
        best = ref_scores.topk(topk, dim=1).values
        return rel_err(picked, best)

    run = Runner(rows, name, flops, nbytes, tol=1e-2)
    run.run("triton", lambda: OURS.indexer_topk(*args_), check)
    scores = _indexer_stages(rows, name, args_, ref_scores, sub, check)
    tix = kernels("indexer")
    # where the scores stage could go faster: bf16 dots (the default widens e4m3 to fp16), wider
    # key blocks, more warps, shallower pipelines, twice or half the splits (default 17 here)
    configs = [{"fp16_dots": False}, {"block_n": 128, "num_warps": 8}, {"num_warps": 8}, {"num_stages": 3},
               {"splits": 34}, {"splits": 8}, {"prefetch": True}, {"prefetch": True, "block_n": 128},
               {"prefetch": True, "block_n": 128, "num_warps": 8},
               # and the selection: compaction steps of 8192 / 2048 columns (default 4096; a step
               # costs 13 CTA barriers at 16 warps in sm_90 builds, whatever its width)
               {"select_chunk": 8192}, {"select_chunk": 2048}]
    if args.sweep:  # the scores stage's grid (an H100 run had it at 88% of the op, 1.06 TB/s)
        tiles = ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8))
        configs += [{"block_n": bn, "num_warps": w, "num_stages": st, **({"splits": sp} if sp else {})}
                    for bn, w in tiles for st in (2, 3, 4) for sp in (None, 64)]
        configs += [{"block_n": bn, "num_warps": w, "prefetch": True, **({"splits": sp} if sp else {})}
                    for bn, w in tiles for sp in (None, 64)]
    sweep(run, lambda config: tix.indexer_topk(*args_, config=tix.IndexerConfig(**config)), check, configs)
    small = (q[:16], w[:16], k_cache, req[:16], positions[:16], table, "fp8", topk)
    run.run("eager", lambda: REF.indexer_topk(*small), check,
            note="timed on 16 of 128 requests (memory); time scaled x8")
    if rows[-1].time_us:
        rows[-1].time_us *= b / 16
    # aiter's logits kernel (paged, fp8) + torch.topk: its Triton top-k sorts a 32K row in one
    # program (and its real DSA top-k is a HIP kernel), so it is left out here.
    run.peer("aiter", lambda: aiter_peers.indexer_runner(*args_, aiter_topk=False), check,
             note="aiter logits + torch.topk")
    _flashinfer_topk_rows(rows, name, scores, topk, check)


def _indexer_stages(rows, name, args_, ref_scores, sub, check):
    """Where the op's time goes: its two launches timed apart on the same inputs. The scores
    stage (floor: the key bytes) against the reference scores of the checked rows; the Triton
    selection and torch.topk each over those scores (-inf filled past the last visible key, as
    the op fills them for torch.topk), checked as the whole op is."""
    from mlagraph.ops.triton import indexer as tix

    q, w, k_cache, req, positions, table, layout, topk = args_
    cfg = tix.IndexerConfig()
    max_len = table.shape[1] * k_cache.shape[1]
    width = max(max_len, topk)
    sms = tix.hardware(q.device).num_sms
    b, ctx = q.shape[0], ref_scores.shape[1]

    def scores():
        return tix._scores(q, w, k_cache, req, positions, table, layout, width, cfg, sms, fill=True)

    key_bytes = b * ctx * k_cache.shape[-1]
    Runner(rows, name, 2 * q.shape[1] * q.shape[2] * b * ctx, key_bytes, tol=1e-3).run(
        "triton stage 1: scores", scores, lambda s: rel_err(s[sub, :ctx], ref_scores))
    s = scores()
    out = torch.empty((b, topk), dtype=torch.int32, device=q.device)

    def select():
        tix._select_triton(s, positions, max_len, topk, out, cfg)
        return out

    def select_torch():
        tix._select_torch(s, topk, out)
        return out

    sel = Runner(rows, name, 0.0, s.numel() * 4, tol=1e-2)
    sel.run("triton stage 2: select", select, check)
    sel.run("torch.topk on the same scores", select_torch, check)
    return s


def _flashinfer_topk_rows(rows, name, scores, topk, check):
    """FlashInfer's radix top-k (flashinfer.top_k, unsorted by default) on our scores, its int64
    indices copied into an int32 output; ours returns the picks in descending order (the op's
    contract), FlashInfer's both ways. Last in the workload: its first call JIT-compiles for
    minutes, and a run cut there keeps every other row."""
    out = torch.empty((scores.shape[0], topk), dtype=torch.int32, device=scores.device)

    def flashinfer_topk(sorted_: bool):
        import flashinfer

        def call():
            out.copy_(flashinfer.top_k(scores, topk, sorted=sorted_)[1])
            return out
        return call

    sel = Runner(rows, name, 0.0, scores.numel() * 4, tol=1e-2)
    sel.peer("flashinfer top_k on the same scores, sorted", lambda: flashinfer_topk(True), check)
    sel.peer("flashinfer top_k on the same scores, unsorted", lambda: flashinfer_topk(False), check)


def _indexer_scores(q, w, k_cache, table, ctx):
    """Exact float32 scores [n, ctx] of each token's keys (for the check only)."""
    rows = k_cache.view(-1, k_cache.shape[-1])
    ps = k_cache.shape[1]
    out = []
    for i in range(q.shape[0]):
        slots = (table[i].long()[:, None] * ps + torch.arange(ps, device="cuda")).flatten()[:ctx]
        keys = layouts.dequantize_index_keys("fp8", rows[slots], torch.float32)
        out.append((w[i][:, None] * torch.relu(q[i].float() @ keys.T)).sum(0))
    return torch.stack(out)


def bench_cache(rows, args, g):
    """Cache write (prefill, 8192 tokens) and read (chunked prefill fetch, 8192 tokens)."""
    n, ps = 8192, 64
    for layout in ("bf16", "fp8_ds"):
        cache, scale, table, lens = paged_cache(layout, [n], ps, g)
        kv_c = torch.randn(n, L, device="cuda", dtype=torch.bfloat16)
        k_pe = torch.randn(n, R, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(cache.shape[0] * ps, device="cuda")[:n]
        name = f"latent_cache_write T={n} {layout}"
        print(name, flush=True)
        # The reference runs on CPU copies: on CUDA, PyTorch turns amax / 448 into amax * (1/448),
        # which can move an fp8_ds group scale by one ulp; the kernel divides exactly.
        want = cache.cpu()
        REF.latent_cache_write(kv_c.cpu(), k_pe.cpu(), want, slots.cpu(), scale, layout)
        flat = lambda c: c.view(-1, c.shape[-1])[slots.cpu()].view(torch.uint8)  # noqa: E731
        check = lambda _: float(not torch.equal(flat(cache.cpu()), flat(want)))  # noqa: E731
        run = Runner(rows, name, 0.0, n * (2 * (L + R) + ROW_BYTES[layout]), tol=0.0)
        w_ours = lambda: OURS.latent_cache_write(kv_c, k_pe, cache, slots, scale, layout)  # noqa: E731
        w_ref = lambda: REF.latent_cache_write(kv_c, k_pe, cache, slots, scale, layout)  # noqa: E731
        run.run("triton", w_ours, check, graph_fns=[w_ours])
        run.run("eager", w_ref, check, graph_fns=[w_ref])
        if args.compile:
            body = inductor(reference_body("cache", "latent_cache_write"))
            w_ind = lambda: body(kv_c, k_pe, cache, slots, scale, layout)  # noqa: E731
            run.run("inductor", w_ind, check, graph_fns=[w_ind])

        name = f"latent_cache_read N={n} {layout}"
        print(name, flush=True)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        a = (cache, table, cu, scale, layout, R, torch.bfloat16, n)
        want = REF.latent_cache_read(*a)
        check = lambda out: max(rel_err(out[0], want[0]), rel_err(out[1], want[1]))  # noqa: E731
        run = Runner(rows, name, 0.0, n * (2 * (L + R) + ROW_BYTES[layout]), tol=1e-3)
        r_ours, r_ref = (lambda: OURS.latent_cache_read(*a)), (lambda: REF.latent_cache_read(*a))
        run.run("triton", r_ours, check, graph_fns=[r_ours])
        run.run("eager", r_ref, check, graph_fns=[r_ref])
        if args.compile:
            body = inductor(reference_body("cache", "latent_cache_read"))
            r_ind = lambda: body(*a)  # noqa: E731
            run.run("inductor", r_ind, check, graph_fns=[r_ind])


def bench_moe(rows, args, g):
    """DeepSeek MoE layers: V2-Lite's (64 experts, hidden 2048, intermediate 1408, top-6) at
    decode and prefill sizes (T = 1K, 4K) and V3's (256 experts, hidden 7168, intermediate
    2048, top-8) at decode and prefill (T = 8192); bytes = the experts the batch touches.
    Rows: ``grouped`` (the generic op: tokens sorted by expert, two grouped GEMMs), ``triton``
    (the triton backend's op: the pair kernels up to PAIRS_PER_EXPERT_MAX, the grouped path
    above), ``triton-pairs`` (the pair kernels forced at every size: where the switch belongs),
    ``triton-sorted`` (our sorted path forced: the one-launch sort and schedule, our grouped
    GEMM reading tokens in place; bf16 and fp8), ``triton-grouped, torch sort`` (the generic
    op's torch sort with our grouped GEMM, what the sorted path replaced: the sort's cost),
    ``triton, 8 layers`` / ``26 layers`` (V2-Lite decode: the op over 8 or 26 copies of the
    experts in turn, as a model reads them: nothing left in L2, and as many pages of memory as
    the model spans) and, with --sweep, tiles; decode sizes are timed as CUDA-graph replays
    (the engine's way)."""
    from common import (V2_LITE_MOE, V3_MOE, moe_floor_bytes, moe_layer_args, torch_sorted_experts,
                        torch_sorted_generic)

    from mlagraph.ops.moe import moe_all_experts, route

    tm = kernels("moe")

    def sorted_path(a, cfg=None, w=None, path=tm.grouped_triton):
        """Our sorted path on moe's arguments (``w``: other experts); ``path=torch_sorted_experts``:
        the same GEMM behind the generic op's torch sort (the sorted path before moe_sort)."""
        gu, dn = (a[2], a[3]) if w is None else w
        return path(a[0], *route(a[1], *a[4:12]), gu, dn, None, a[12], a[13], config=cfg)

    def torch_sorted(a, w=None):
        return sorted_path(a, w=w, path=torch_sorted_experts)

    def generic_torch_sort(a):
        """The triton op's prefill path behind torch's sort, as it was before the blocked sort."""
        return torch_sorted_generic(a[0], *tm.route(a[1], *a[4:12]), a[2], a[3], a[12], a[13], a[1].shape[1])

    limits = dict(tm.PAIRS_PER_EXPERT_MAX)

    def forced_pairs(a):
        tm.PAIRS_PER_EXPERT_MAX.update(bf16=1e9, fp8=1e9)  # only while the call (or its capture) runs
        try:
            return OURS.moe(*a)
        finally:
            tm.PAIRS_PER_EXPERT_MAX.update(limits)

    cases = [("V2-Lite", V2_LITE_MOE, False, (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)),
             ("V3", V3_MOE, False, (1, 4, 8, 16, 32, 128, 256, 8192)),
             ("V3", V3_MOE, True, (1, 4, 8, 16, 32, 128, 256, 8192))]
    grouped_cfgs = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
                    for m, n, w, st in ((16, 64, 4, 3), (16, 64, 4, 5), (16, 128, 4, 4), (16, 128, 8, 4),
                                        (16, 256, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 4))]
    # bf16 experts only: K steps other than the fp8 scale block
    grouped_k_cfgs = [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
                      for m, n, k, w, st in ((16, 128, 64, 4, 4), (16, 64, 256, 4, 3), (16, 128, 256, 4, 2),
                                             (16, 128, 256, 8, 3), (16, 64, 128, 2, 4), (16, 32, 256, 2, 4),
                                             # long runs of each weight row (1-2 KB), at stages that keep
                                             # two or more copy buffers (sm90_build.py --form grouped: at 2
                                             # stages the pipeliner keeps one, no load overlaps the MMAs)
                                             (16, 32, 512, 4, 3), (16, 32, 512, 4, 4), (16, 32, 1024, 4, 3),
                                             (16, 16, 1024, 4, 3), (16, 16, 512, 2, 4), (16, 32, 512, 8, 4),
                                             (16, 64, 256, 4, 4))]
    sweep_cfgs = [{"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4},
                  {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8}, {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8},
                  {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}, {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2},
                  {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8}, {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4},
                  {"BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 8}, {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 8},
                  {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 8}, {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 8}]
    # software pipelining depth of the pair GEMVs' K loop (Triton's default otherwise)
    sweep_cfgs += [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": st}
                   for n, k, w in ((16, 512, 4), (8, 512, 2), (8, 256, 2), (4, 512, 2), (16, 256, 4)) for st in (1, 2, 4)]
    for model, dims, fp8, tokens in cases:
        label = "fp8" if fp8 else "bf16"
        if args.moe_cases and f"{model}-{label}" not in args.moe_cases.split(","):
            continue
        base = moe_layer_args(max(tokens), device="cuda", fp8=fp8, **dims)
        layer_copies = None  # V2-Lite: 8 layers' experts, made at the first decode size
        for t in tokens:
            if args.moe_tokens and str(t) not in args.moe_tokens.split(","):
                continue
            a = (base[0][:t], base[1][:t], *base[2:])
            nbytes, touched = moe_floor_bytes(a)
            name = f"moe {model} T={t} {label} ({touched} experts)"
            print(name, flush=True)
            want = moe_all_experts(*a)
            check = lambda out, want=want: rel_err(out, want)  # noqa: E731
            # W8A8 (fp8 prefill) carries e4m3's rounding of the activations before both GEMMs:
            # 4.4% relative on the H200 (tests/ops/test_moe.py), hence its wider tolerance.
            tol = 6e-2 if fp8 and t > 128 else 2e-2
            flops = 2 * t * dims["top_k"] * 3 * dims["dim"] * dims["inter"]
            run = Runner(rows, name, flops, nbytes, tol=tol)
            decode = t <= 256

            def variant(label_, fn):
                run.run(label_, fn, check, **({"graph_fns": [fn]} if decode else {}))

            variant("grouped-fp8" if fp8 else "grouped", lambda a=a: REF.moe(*a))
            variant("triton", lambda a=a: OURS.moe(*a))
            if not decode:  # the triton op's prefill path behind torch's sort, as it was before 12-06
                variant("triton-generic, torch sort", lambda a=a: generic_torch_sort(a))
            if decode:
                variant("triton-pairs", lambda a=a: forced_pairs(a))
                variant("triton-sorted", lambda a=a: sorted_path(a))
                variant("triton-grouped, torch sort", lambda a=a: torch_sorted(a))
                if args.sweep and t >= 32:
                    for cfg in grouped_cfgs + ([] if fp8 else grouped_k_cfgs):
                        variant("triton-sorted:" + ",".join(f"{k}={v}" for k, v in cfg.items()),
                                lambda a=a, cfg=cfg: sorted_path(a, cfg))
                if args.sweep_pairs and t <= 16:
                    fp8_cfgs = [{"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4},
                                {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4},
                                {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2},
                                {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4},
                                {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8},
                                {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 8},
                                {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4}]
                    for cfg in sweep_cfgs if not fp8 else fp8_cfgs:
                        cfg_name = "triton-pairs:" + ",".join(f"{k}={v}" for k, v in cfg.items())
                        variant(cfg_name, lambda a=a, cfg=cfg: tm.routed_experts(
                            a[0], *route(a[1], *a[4:12]), a[2], a[3], a[12], a[13], None, config=cfg))
            if model == "V2-Lite" and decode and t <= 128:
                # The model reads another layer's experts each call, so L2 holds none of them:
                # the same op over 8 and 26 layers' weights (26: V2-Lite's MoE layers, 29 GB, as
                # many memory pages as the model's experts span), timed per call.
                if layer_copies is None:
                    layer_copies = [(a[2], a[3])] + [(a[2].clone(), a[3].clone()) for _ in range(25)]
                for n in (8, 26):
                    layers = [lambda w=w, a=a: OURS.moe(a[0], a[1], w[0], w[1], *a[4:]) for w in layer_copies[:n]]
                    run.run(f"triton, {n} layers", layers[0], check, graph_fns=layers)
                if t >= 16:
                    fns = [lambda w=w, a=a: sorted_path(a, w=w) for w in layer_copies]
                    run.run("triton-sorted, 26 layers", fns[0], check, graph_fns=fns)
                    fns = [lambda w=w, a=a: torch_sorted(a, w=w) for w in layer_copies]
                    run.run("triton-grouped, torch sort, 26 layers", fns[0], check, graph_fns=fns)
                if args.sweep_pairs and t <= 16:
                    for cfg in sweep_cfgs:
                        fns = [lambda w=w, a=a, cfg=cfg: tm.routed_experts(
                            a[0], *route(a[1], *a[4:12]), w[0], w[1], None, None, None, config=cfg)
                            for w in layer_copies[:8]]
                        run.run("triton-pairs, 8 layers:" + ",".join(f"{k}={v}" for k, v in cfg.items()),
                                fns[0], check, graph_fns=fns)
            if model == "V3" and (t == 1 or t == max(tokens)) and not (fp8 and t > 1):
                # the oracle as a peer at the ends only (fp8: it dequantizes all 256 experts
                # per call, 110 ms, and 28 GiB at T=8K)
                torch.cuda.empty_cache()
                run.run("all-experts", lambda a=a: moe_all_experts(*a), check)
            del want
        del base, layer_copies
        torch.cuda.empty_cache()


@triton.jit
def _stream_read_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Only reads: ITERS blocks of BLOCK contiguous elements a program, summed in float32, one
    float out per program: the floor any reader of these bytes has."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _tile_read_kernel(w_ptr, out_ptr, N, K, stride_e, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reads [E, N, K] weights as the grouped GEMM's programs do, and computes nothing: program
    (e, n) walks rows n*BLOCK_N.. of expert e along K, BLOCK_K columns a step (expert fastest in
    the grid, as the GEMM's M tiles are), summing in float32. Plain loads (no copy pipeline;
    built for sm_90, 48-80 registers), so as many programs an SM as fit keep loads in flight:
    what it isolates is the order in which the bytes are asked for."""
    e, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    base = w_ptr + e.to(tl.int64) * stride_e + cols[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N], tl.float32)  # one sum a row: few registers, so occupancy is not what differs
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(base + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += tl.sum(tile.to(tl.float32), 1)
    tl.store(out_ptr + e * tl.num_programs(1) + pid_n, tl.sum(acc, 0))


def bench_moe_bw(rows, args, g):
    """What bounds the grouped GEMM at decode sizes (V2-Lite batch 32 ran as fast on the H100 as
    on the H200, about 2.6-2.75 TB/s, whatever its tiles). The same stacked gate_up weights
    (V2-Lite: 64 experts x 2816 x 2048 bf16, 738 MB) read by: a kernel that only reads them in
    order (the floor any reader has); one that only reads them in the grouped GEMM's tiles (the
    access pattern's cost, without the GEMM); ``copy_`` (read + write); cuBLAS's batched GEMM at
    4 and 16 rows an expert; our grouped GEMM (gate_up only) at T = 32, top-6 over all 64
    experts and over 16 of them (the same rows and tiles, a quarter of the pages), at the
    default tile, at tiles whose rows run 1-2 KB along K, with 4-5 stages or 8 warps, and as
    persistent programs (1-2 an SM, item and K loops flattened: no empty pipeline per tile). Each checked first (the reads
    against torch's float32 sum, the GEMMs against a float32 product)."""
    from mlagraph.ops.triton.grouped_fp8 import config_for, run_tiles
    from mlagraph.ops.triton.moe_sort import sort_pairs

    experts, n, k, t, top_k = 64, 2816, 2048, 32, 6
    w = (torch.randn(experts, n, k, generator=g) * 0.02).to("cuda", torch.bfloat16)
    x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    name = f"moe_bw V2-Lite gate_up ({nbytes / 1e6:.0f} MB)"
    print(name, flush=True)
    flat = w.view(-1)
    want_sum = flat.float().sum()
    check_sum = lambda part: rel_err(part.sum(), want_sum)  # noqa: E731  (the reads' per-program sums)
    for block, iters in ((8192, 4), (8192, 16)):
        part = torch.empty(-(-flat.numel() // (block * iters)), device="cuda")

        def fn(part=part, block=block, iters=iters):
            _stream_read_kernel[(part.numel(),)](flat, part, flat.numel(), BLOCK=block, ITERS=iters, num_warps=8)
            return part
        Runner(rows, name, 0.0, nbytes, tol=1e-3).run(f"read in order ({block} x {iters} a program)", fn, check_sum)
    for block_n, block_k in ((128, 128), (128, 64), (32, 512), (16, 1024), (64, 256)):
        part = torch.empty(experts * -(-n // block_n), device="cuda")

        def fn(part=part, block_n=block_n, block_k=block_k):
            _tile_read_kernel[(experts, -(-n // block_n))](w, part, n, k, w.stride(0), BLOCK_N=block_n,
                                                           BLOCK_K=block_k, num_warps=4)
            return part
        Runner(rows, name, 0.0, nbytes, tol=1e-3).run(f"read in GEMM tiles ({block_n} rows x {block_k} a step)", fn,
                                                      check_sum)
    dst = torch.empty_like(w)
    Runner(rows, name, 0.0, 2 * nbytes, tol=0.0).run(
        "copy_ (bytes read + written)", lambda: dst.copy_(w), lambda out: float(not torch.equal(out, w)))
    for m in (4, 16):
        xb = torch.randn(experts, m, k, generator=g).to("cuda", torch.bfloat16)
        want = torch.bmm(xb.float(), w.float().transpose(1, 2))
        Runner(rows, name, 2.0 * experts * m * n * k, nbytes, tol=2e-2).run(
            f"cuBLAS bmm, {m} rows an expert", lambda xb=xb: torch.bmm(xb, w.transpose(1, 2)),
            lambda out, want=want: rel_err(out, want))
        del want
    for spread in (experts, 16):
        ids = torch.stack([torch.randperm(spread, generator=g)[:top_k] for _ in range(t)]).to("cuda")
        touched = ids.unique().numel() * n * k * w.element_size()
        pair_rows = x.float()[torch.arange(t * top_k, device="cuda") // top_k]  # pair p = (token p // k, slot p % k)
        want_pairs = torch.einsum("pk,pnk->pn", pair_rows, w[ids.view(-1)].float())
        # more stages / warps: more bytes in flight per SM, which a faster memory needs to
        # reach its rate (the H200's copy rate is 1.4x the H100's, with the same SM count)
        for cfg in ({}, {"BLOCK_N": 128, "BLOCK_K": 128}, {"BLOCK_N": 32, "BLOCK_K": 512},
                    {"BLOCK_N": 16, "BLOCK_K": 1024, "num_stages": 3}, {"num_stages": 4}, {"num_stages": 5},
                    {"num_warps": 8, "num_stages": 4}, {"PERSISTENT": 2}, {"PERSISTENT": 1, "num_stages": 4},
                    {"PERSISTENT": 1, "num_stages": 5}, {"PERSISTENT": 2, "BLOCK_N": 128, "BLOCK_K": 128}):
            c = config_for(t * top_k, experts, n, x.device, cfg, half_experts=True)
            sort = sort_pairs(ids, experts, c["BLOCK_M"])
            fn = lambda c=c, sort=sort: run_tiles(  # noqa: E731
                x, w, None, sort.schedule, t * top_k, c, order=sort.order, top_k=top_k)
            check = lambda out, sort=sort: rel_err(out, want_pairs[sort.order.long()])  # noqa: E731
            label = ",".join(f"{key}={v}" for key, v in cfg.items()) or "default tile"
            Runner(rows, name, 2.0 * t * top_k * n * k, touched, tol=2e-2).run(
                f"triton grouped, over {spread} experts: {label}", fn, check, graph_fns=[fn])


def bench_route(rows, args, g):
    """MoE routing alone: the generic op's torch ops (softmax / sigmoid, grouped top-k, gather,
    normalisation) against the triton backend's one launch, for V2-Lite's router (64 experts,
    greedy top-6) and V3's (256 in 8 groups, noaux_tc top-8), at decode sizes as CUDA-graph
    replays and at prefill. Checked: the same experts per token, weights within 1e-5."""
    from mlagraph.ops.moe import route as torch_route

    tr = kernels("route")
    routers = [("V2-Lite", 64, ("softmax", "greedy", 1, 1), 6, False, 1.0),
               ("V3", 256, ("sigmoid", "noaux_tc", 8, 4), 8, True, 2.5)]
    for model, experts, (scoring, method, n_group, topk_group), top_k, norm, scale in routers:
        bias = torch.randn(experts, device="cuda") * 0.1 if method == "noaux_tc" else None
        for t in (1, 32, 128, 8192):
            logits = torch.randn(t, experts, device="cuda")
            a = (logits, bias, top_k, scoring, method, n_group, topk_group, norm, scale)
            want_w, want_ids = torch_route(*a)
            want_ids, order = want_ids.sort(1)
            want_w = want_w.gather(1, order)

            def check(out, want_w=want_w, want_ids=want_ids):
                ids, order = out[1].sort(1)
                if not torch.equal(ids, want_ids):
                    return float("inf")
                return rel_err(out[0].gather(1, order), want_w)

            name = f"route {model} T={t}"
            print(name, flush=True)
            run = Runner(rows, name, 0.0, t * experts * 4, tol=1e-5)
            decode = t <= 256
            for label, fn in (("torch", lambda a=a: torch_route(*a)), ("triton", lambda a=a: tr.route(*a))):
                run.run(label, fn, check, **({"graph_fns": [fn]} if decode else {}))


def reference_body(module: str, op: str):
    """A reference op's plain-PyTorch body, undecorated, so torch.compile traces into it (the
    custom op itself is opaque to Inductor). ``module`` is kept for the call sites' reading."""
    from mlagraph.ops._define import op_body

    return op_body(f"mlagraph::{op}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for kernels.json and kernels.png")
    p.add_argument("--only", default="", help="comma-separated workloads: " + ",".join(WORKLOADS))
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile peers")
    p.add_argument("--sweep", action="store_true",
                   help="also time config variants of our kernels (triton's, and the aiter backend's decode)")
    p.add_argument("--flash-parts", default="decode,sparse,prefill",
                   help="flash only: comma list of its parts (decode, sparse, prefill; heads: B=128 L=4096 decode at 1-128 heads)")
    p.add_argument("--new-forms", action="store_true",
                   help="flash and decode: also time the Gluon forms not yet run on a GPU (seesaw.py: dense decode "
                        "past 16 rows and bf16 sparse; decode_stream.py: the keys form's twin up to 32 rows, every "
                        "cache layout; sparse_wgmma's fp8_ds kernel). Opt-in: a schedule that deadlocked would "
                        "stall the run here, so run their GPU tests first")
    p.add_argument("--moe-cases", default="", help="moe only: comma list of V2-Lite-bf16, V3-bf16, V3-fp8 (default all)")
    p.add_argument("--moe-tokens", default="", help="moe only: comma list of token counts (default all)")
    p.add_argument("--sweep-pairs", action="store_true", help="moe only: also sweep the pair kernels' tiles")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py times GPU kernels: no CUDA device here")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows: list[Row] = []
    picked = [w for w in WORKLOADS if not args.only or w in args.only.split(",")]
    for w in picked:
        t0 = time.time()
        try:
            WORKLOADS[w](rows, args, g)
        except Exception:  # keep the other workloads' numbers
            traceback.print_exc()
        print(f"[{w}: {time.time() - t0:.0f} s]", flush=True)
        save(rows, args.out)  # after every workload: a run cut short keeps what it measured
    report(rows, args.out)


def save(rows: list[Row], out: str | None) -> str | None:
    """Writes OUT/kernels.json; returns its path."""
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "peak_flops": PEAK_FLOPS, "peak_bytes": PEAK_BYTES,
               "rows": [dict(dataclasses.asdict(r), floor_us=r.floor_us, rate=r.rate()) for r in rows]}
    path = os.path.join(out, "kernels.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def report(rows: list[Row], out: str | None) -> None:
    best_peer: dict[str, float] = {}
    for r in rows:
        if r.time_us is not None and not r.variant.startswith(OUR_VARIANTS):
            best_peer[r.workload] = min(best_peer.get(r.workload, math.inf), r.time_us)
    dev = torch.cuda.get_device_name()
    print(f"\n{dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'workload':<44} {'variant':<16} {'time us':>9} {'rate':>14} {'vs best peer':>12} {'% floor':>8} note")
    for r in rows:
        t = f"{r.time_us:.1f}" if r.time_us is not None else "-"
        ratio = ""
        if r.time_us and r.variant.startswith(OUR_VARIANTS) and r.workload in best_peer:
            ratio = f"{best_peer[r.workload] / r.time_us:.2f}x"
        pct = f"{100 * r.floor_us / r.time_us:.0f}%" if r.time_us else ""
        print(f"{r.workload:<44} {r.variant:<16} {t:>9} {r.rate():>14} {ratio:>12} {pct:>8} {r.note}")
    if out:
        path = save(rows, out)
        try:
            from plot_kernels import plot

            plot(path, os.path.join(out, "kernels.png"))
        except ImportError as e:
            print(f"(no plot: {e}; run python benchmarks/plot_kernels.py {path})")


from flash_peers import bench_flash  # noqa: E402  (the flashmla / flashinfer backends beside the raw kernels)

WORKLOADS = {"fused": bench_fused, "decode": bench_decode, "prefill": bench_prefill, "sparse": bench_sparse,
             "cache": bench_cache, "indexer": bench_indexer, "moe": bench_moe, "route": bench_route,
             "flash": bench_flash, "moe_bw": bench_moe_bw}

if __name__ == "__main__":
    main()
