"""Compile time at depth: regional vs whole-model compilation, and what mlagraph's passes add.

    python benchmarks/compile_time.py [--depths 2,8,27,61] [--modes regional,whole]
        [--device cpu|cuda] [--batch B] [--timeout S] [--out DIR]
    python benchmarks/compile_time.py --passes [--device cpu|cuda] [--repeats 3]   # passes' overhead

Depth sweep: for each depth and mode (``regional``: mlagraph.compile's default, one graph per
kind of layer block; ``whole``: ``regional=False``, one graph per batch variant holding every
layer), a fresh process builds a random model, an Engine with ``compile=True`` (and on CUDA
``cuda_graphs=True`` with the one bucket ``--batch``), and runs one generate of ``--batch``
prompts for 2 tokens (the prefill graph compiles; the first decode runs). It prints:

- compile s: time spent compiling (``engine.startup.compile_s``: every variant's graphs);
- capture s: CUDA-graph capture and its warm-up runs, compiling excluded (``capture_s``);
- ready s: engine construction to the end of that first generate (compile + capture + warm-up:
  the time before the first decode of a batch; the issue's goal on the H200 is 60 s for V2-Lite);
- step ms: one decode step of ``--batch`` requests (median over a second generate).

Models: on CUDA, DeepSeek-V2-Lite's dimensions (bf16, random weights, ``depth`` layers); on CPU,
examples/generate.py's tiny V3-shaped model at ``depth`` layers (float32). Each run gets fresh
Inductor and Triton cache directories, seeded only with the CPU's vector-ISA probe (a one-time
cost of any machine, not of a model), so every graph really compiles. A run past ``--timeout``
is reported as such. ``--out DIR`` writes compile_time.json and compile_time.md.

``--passes``: the first call (trace + Inductor codegen) of a 4-layer V3-shaped model's prefill
and decode graph, FX graph cache off, for plain ``torch.compile``, ``mlagraph.compile(passes=(),
lint=False)`` and ``mlagraph.compile``; goal: the passes add < 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


# --- the depth sweep ----------------------------------------------------------------------------


def model_config(depth: int, cuda: bool) -> dict:
    if cuda:
        from e2e_model import hf_config_dict

        return hf_config_dict(smoke=False) | {"num_hidden_layers": depth}
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from generate import TINY_V3

    return TINY_V3 | {"num_hidden_layers": depth}


def one_depth(depth: int, mode: str, device: str, batch: int, prompt_len: int, steps: int) -> dict:
    import random

    import torch

    from mlagraph.engine import StepStats
    from mlagraph.model import DeepseekForCausalLM, Engine

    cuda = device.startswith("cuda")
    model = DeepseekForCausalLM.from_config(model_config(depth, cuda), device=device,
                                            dtype=torch.bfloat16 if cuda else torch.float32,
                                            backend="triton" if cuda else "reference")
    rnd = random.Random(0)
    prompts = [[rnd.randrange(model.config.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    t0 = time.perf_counter()
    engine = Engine(model, max_num_seqs=batch, max_model_len=prompt_len + steps + 8, page_size=64 if cuda else 16,
                    compile=True, cuda_graphs=cuda, cuda_graph_batch_sizes=[batch] if cuda else None,
                    compile_options={"regional": mode == "regional"}, progress=False)
    engine.generate(prompts, max_new_tokens=2, ignore_eos=True)
    ready = time.perf_counter() - t0
    startup = engine.startup
    engine.stats = StepStats()
    engine.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)
    s = engine.stats
    return {"depth": depth, "mode": mode, "compile_s": startup.compile_s, "capture_s": startup.capture_s,
            "ready_s": ready, "step_ms": s.decode_seconds / (s.decode_tokens / batch) * 1e3,
            "graphs": engine.compiled_graphs}


def isa_probe() -> None:
    """Compiles one tiny function: leaves Inductor's CPU vector-ISA probe in the cache directory."""
    import torch

    torch.compile(lambda x: (x * 2).sum())(torch.randn(64))


def sweep(args) -> None:
    from common import device_name, write_json

    template = tempfile.mkdtemp(prefix="compile_time_isa_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=template)
    subprocess.run([sys.executable, __file__, "--isa-probe"], env=env, check=True, capture_output=True)
    rows = []
    for depth in args.depths:
        for mode in args.modes:
            run_dir = tempfile.mkdtemp(prefix="compile_time_")
            shutil.copytree(template, os.path.join(run_dir, "inductor"))
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(run_dir, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(run_dir, "triton"))
            cmd = [sys.executable, __file__, "--one", str(depth), mode, "--device", args.device,
                   "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--steps", str(args.steps)]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode:
                    row = {"depth": depth, "mode": mode, "error": proc.stderr.strip().splitlines()[-1:]}
                else:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"depth": depth, "mode": mode, "error": f"timeout after {args.timeout} s"}
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
            rows.append(row)
            print(_row_text(row), flush=True)
    shutil.rmtree(template, ignore_errors=True)
    title = f"compile time by depth, {device_name(args.device)}, batch {args.batch}"
    table = "\n".join([f"{title}\n", HEADER, "|---|---|---:|---:|---:|---:|---:|", *map(_row_text, rows)])
    print("\n" + table)
    write_json(args.out, "compile_time.json", {"device": device_name(args.device), "batch": args.batch, "rows": rows})
    if args.out:
        with open(os.path.join(args.out, "compile_time.md"), "w") as f:
            f.write(table + "\n")


HEADER = "| layers | mode | compile s | capture s | ready s | step ms | graphs |"


def _row_text(r: dict) -> str:
    if "error" in r:
        return f"| {r['depth']} | {r['mode']} | {r['error']} | | | | |"
    return (f"| {r['depth']} | {r['mode']} | {r['compile_s']:.1f} | {r['capture_s']:.1f} | {r['ready_s']:.1f} | "
            f"{r['step_ms']:.2f} | {r['graphs']} |")


# --- the passes' overhead -------------------------------------------------------------------------


def one_passes(variant: str, device: str) -> dict:
    import torch

    import mlagraph
    from common import decode_batch, deepseek_v3_config
    from mlagraph.model import DeepseekForCausalLM
    from mlagraph.model.batch import build_batch

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


def passes_overhead(args) -> None:
    import statistics

    from common import device_name, write_json

    runs = {"inductor": [], "no_passes": [], "mlagraph": []}
    for _ in range(args.repeats):
        for variant in runs:  # interleaved, so drifts in machine load hit both alike
            proc = subprocess.run([sys.executable, __file__, "--one-passes", variant, "--device", args.device],
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
    write_json(args.out, "compile_time_passes.json", {"device": device_name(args.device), "rows": rows})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--depths", default="2,8,27,61", help="layer counts to sweep")
    p.add_argument("--modes", default="regional,whole", help="regional, whole or both")
    p.add_argument("--batch", type=int, default=None, help="decode batch (default: 32 on cuda, 4 on cpu)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (depth, mode) run")
    p.add_argument("--out", default=None, help="folder for compile_time.json / .md")
    p.add_argument("--passes", action="store_true", help="measure what mlagraph's passes add instead")
    p.add_argument("--repeats", type=int, default=3, help="--passes: fresh processes per variant (median)")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--one-passes", choices=["inductor", "no_passes", "mlagraph"], help=argparse.SUPPRESS)
    p.add_argument("--isa-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batch = args.batch or (32 if args.device.startswith("cuda") else 4)
    if args.isa_probe:
        return isa_probe()
    if args.one:
        print(json.dumps(one_depth(int(args.one[0]), args.one[1], args.device, args.batch, args.prompt_len,
                                   args.steps)))
        return
    if args.one_passes:
        print(json.dumps(one_passes(args.one_passes, args.device)))
        return
    if args.passes:
        return passes_overhead(args)
    args.depths = [int(d) for d in args.depths.split(",")]
    args.modes = args.modes.split(",")
    unknown = set(args.modes) - {"regional", "whole"}
    if unknown:
        p.error(f"--modes: expected regional and/or whole, got {sorted(unknown)}")
    sweep(args)


if __name__ == "__main__":
    main()
