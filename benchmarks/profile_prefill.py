"""Where a prefill's time goes: wall time against GPU kernel time, per prompt length.

    python benchmarks/profile_prefill.py [--prompts 1024 4096] [--layers 27] [--backend triton] [--out DIR]

Builds DeepSeek-V2-Lite's dims (benchmarks/e2e_model.py's V2_LITE; random weights, bf16) with
--layers layers and an Engine as e2e_model.py makes it (compile + CUDA graphs; prefill runs
compiled, outside the graphs), then for each prompt length:
  - the wall time of ``engine.generate([prompt], max_new_tokens=1)``, every iteration (not only
    the median: the spread is what this measures);
  - the same call under torch.profiler: GPU kernel time summed, kernel count, and the share of
    the wall time the GPU had no kernel (host-bound when large), plus the top kernels;
  - with --cprofile, the same call under cProfile: the Python functions the host time goes to.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_model import V2_LITE, random_prompt  # noqa: E402

from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402


def wall_times(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def gpu_busy(prof) -> tuple[float, int]:
    """Seconds of GPU kernel time and the number of kernels in a profile."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels) / 1e6, len(kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--backend", default="triton")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", action="store_true", help="also the host time by Python function")
    args = p.parse_args()

    config = {**V2_LITE, "num_hidden_layers": args.layers, "model_type": "deepseek_v2"}
    model = DeepseekForCausalLM.from_config(config, backend=args.backend, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    engine = Engine(model, max_num_seqs=1, max_model_len=max(args.prompts) + 16, page_size=64, compile=True,
                    cuda_graphs=True, cuda_graph_batch_sizes=[1])
    print(f"engine (compile + capture): {time.perf_counter() - t0:.1f}s", flush=True)

    from torch.profiler import ProfilerActivity, profile

    lines = []
    for n in args.prompts:
        prompt = random_prompt(n, config["vocab_size"], seed=n)
        run = lambda: engine.generate([prompt], max_new_tokens=1)  # noqa: E731
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        times = wall_times(run, args.iters)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            profiled = time.perf_counter() - t0
        busy, count = gpu_busy(prof)
        med = statistics.median(times)
        line = (f"prefill {n}: first call {first:.2f} s | wall median {med * 1e3:.1f} ms "
                f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}; {n / med:.0f} tok/s) | profiled call "
                f"{profiled * 1e3:.1f} ms: GPU kernels {busy * 1e3:.1f} ms in {count} kernels, GPU idle "
                f"{max(profiled - busy, 0) / profiled:.0%}")
        print(line, flush=True)
        print("  all iterations (ms): " + " ".join(f"{t * 1e3:.1f}" for t in times), flush=True)
        lines.append(line)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=80)
        cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=80)
        print(table, flush=True)
        if args.cprofile:
            import cProfile
            import io
            import pstats

            host = cProfile.Profile()
            host.runcall(run)
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(40)
            cpu_table += "\n\ncProfile, by own time:\n" + text.getvalue()
            print("\n".join(text.getvalue().splitlines()[:60]), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"profile_prefill_{args.layers}L_{n}.txt"), "w") as f:
                f.write(line + "\n\n" + table + "\n\nby host time:\n" + cpu_table)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
