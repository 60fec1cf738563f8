"""Compile time of a 4-layer DeepSeek-V3-shaped model with and without mlagraph's passes.

    python benchmarks/compile_time.py [--device cpu|cuda] [--out DIR]

Times the first call (trace + Inductor codegen) of the prefill and the decode graph, with the
FX graph cache off so every compile is real, for: plain ``torch.compile`` (Inductor, for
reference), ``mlagraph.compile(passes=(), lint=False)`` (the same dynamo settings without our
passes) and ``mlagraph.compile`` (with fusion, concat elimination and lints). Goal: the passes
add < 10% (the last two compared). Each variant runs in fresh processes (``--repeats``, median reported) so nothing is
shared; the time mlagraph's pass manager itself spends (passes, lints, printing) is measured
inside the compile and reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(variant: str, device: str) -> dict:
    import torch

    import mlagraph
    from mlagraph.model import DeepseekForCausalLM
    from mlagraph.model.batch import build_batch

    sys.path.insert(0, HERE)
    from common import decode_batch, deepseek_v3_config

    torch._inductor.config.fx_graph_cache = False
    model = DeepseekForCausalLM.from_config(deepseek_v3_config(layers=4), device=device)
    caches = model.allocate_caches(256, 16)
    if variant == "mlagraph":
        step = mlagraph.compile(model, fullgraph=True, dynamic=True)
    elif variant == "no_passes":
        step = mlagraph.compile(model, fullgraph=True, dynamic=True, passes=(), lint=False)
    else:
        step = torch.compile(model, fullgraph=True, dynamic=True)
    prefill = build_batch(model.backend.capabilities, [list(range(40)), list(range(24))], [0, 0],
                          [[0, 1, 2], [3, 4]], 16, device=device)
    out = {}
    for name, batch in (("prefill", prefill), ("decode", decode_batch(model, 4, 100, 16, first_page=8))):
        t0 = time.perf_counter()
        with torch.no_grad():
            step(batch, caches)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out[name] = time.perf_counter() - t0
        report = mlagraph.passes.last_compile()
        out[name + "_passes"] = report.seconds if (variant == "mlagraph" and report) else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="folder for compile_time.json")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (median)")
    p.add_argument("--one", choices=["inductor", "no_passes", "mlagraph"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.device)))
        return
    sys.path.insert(0, HERE)
    from common import device_name, write_json

    import statistics

    runs = {"inductor": [], "no_passes": [], "mlagraph": []}
    for _ in range(args.repeats):
        for variant in runs:  # interleaved, so drifts in machine load hit both alike
            proc = subprocess.run([sys.executable, __file__, "--one", variant, "--device", args.device],
                                  capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for graph in ("prefill", "decode"):
        med = {v: statistics.median(r[graph] for r in runs[v]) for v in runs}
        passes = statistics.median(r[graph + "_passes"] for r in runs["mlagraph"])
        rows.append({"graph": graph, "inductor_s": med["inductor"], "no_passes_s": med["no_passes"],
                     "mlagraph_s": med["mlagraph"], "pass_manager_s": passes,
                     "passes_add_pct": 100 * (med["mlagraph"] / med["no_passes"] - 1)})
    print(f"compile time, 4-layer DeepSeek-V3-shaped model, {device_name(args.device)}, median of {args.repeats}")
    print(f"{'graph':<8} {'inductor':>9} {'no passes':>10} {'passes':>9} {'passes add':>11} {'pass manager':>13}")
    for r in rows:
        print(f"{r['graph']:<8} {r['inductor_s']:>8.1f}s {r['no_passes_s']:>9.1f}s {r['mlagraph_s']:>8.1f}s "
              f"{r['passes_add_pct']:>10.1f}% {r['pass_manager_s'] * 1e3:>10.0f} ms")
    write_json(args.out, "compile_time.json", {"device": device_name(args.device), "rows": rows})


if __name__ == "__main__":
    main()
