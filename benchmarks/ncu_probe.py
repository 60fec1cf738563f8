"""One launch of each memory-bound kernel we trail the field on, for Nsight Compute to read.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python benchmarks/ncu_probe.py [--cases decode_h16,decode_h32,indexer]

Every variant runs once to compile and check, then once between cudaProfilerStart / Stop, so
ncu (with ``--profile-from-start off``) profiles exactly those launches; the script prints the
order, so a report's kernels map to variants. Cases:

- ``decode_h16``: ``mla_decode`` at H=16, B=128, L=4096, bf16 (memory-bound: our forms run at
  ~3.2 TB/s on the H200 where FlashMLA and FlashInfer reach ~4.2): the default (keys form) and
  FlashMLA's kernel on the same inputs.
- ``decode_h32``: the same at H=32 (the Gluon form).
- ``indexer``: the DSA indexer's scores stage at decode, B=128, 32K fp8 keys (1.06 TB/s on the
  H100): the default pipeliner and the explicit prefetch.
Without a GPU it exits with a message.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _profiled(name: str, fn, check) -> None:
    out = fn()
    torch.cuda.synchronize()
    print(f"{name}: check {check(out):.2e}", flush=True)
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"  profiled: {name}", flush=True)


def decode(h: int, g) -> None:
    from flash_peers import _decode_case, _raw_flashmla_decode

    args_, check = _decode_case(h, 128, 4096, 1, g)
    _profiled(f"decode H={h} ours (default)", lambda: torch.ops.mlagraph_triton.mla_decode(*args_), check)
    try:
        fm = _raw_flashmla_decode(*args_[:5], "bf16")[0]
    except ImportError as e:
        print(f"  flashmla: {e}")
        return
    _profiled(f"decode H={h} flashmla raw", lambda: (fm(),), check)


def indexer(g) -> None:
    from kernels import _indexer_scores, indexer_decode_case, rel_err

    from mlagraph.ops.triton import indexer as tix

    ctx = 32768
    q, w, k_cache, req, positions, table = indexer_decode_case(128, ctx)
    want = _indexer_scores(q[:4], w[:4], k_cache, table[:4], ctx)
    sms = tix.hardware(q.device).num_sms
    for label, cfg in (("default", tix.IndexerConfig()), ("bf16 dots", tix.IndexerConfig(fp16_dots=False)),
                       ("prefetch", tix.IndexerConfig(prefetch=True))):
        _profiled(f"indexer scores {label}",
                  lambda cfg=cfg: tix._scores(q, w, k_cache, req, positions, table, "fp8", ctx, cfg, sms),
                  lambda s: rel_err(s[:4, :ctx], want))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="decode_h16,decode_h32,indexer")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ncu_probe.py profiles GPU kernels: no CUDA device here")
    import kernels  # noqa: F401  (benchmarks/kernels.py: registers the backends' ops)

    g = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        if case.startswith("decode_h"):
            decode(int(case[len("decode_h"):]), g)
        elif case == "indexer":
            indexer(g)
        else:
            sys.exit(f"--cases: unknown case {case!r} (decode_h16, decode_h32, indexer)")


if __name__ == "__main__":
    main()
