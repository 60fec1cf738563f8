"""Where a decode step's time goes: the engine step, the graph replay alone, and per kernel.

    python benchmarks/profile_decode.py --batch 32 --ctx 1024 [--layers 2] [--backend triton] [--out DIR]
        [--model v3-shaped|v2-lite] [--moe backend|reference]

Builds the random DeepSeek-V3-shaped model (mlagraph.model.config.deepseek_v3_shaped, bf16),
an Engine with compile + CUDA graphs for exactly this batch size, fills the latent cache with
random values and makes ``batch`` requests with ``ctx`` cached tokens each, then reports:
  - the engine's decode step (host metadata + copies + replay + sync), median of --iters;
  - the replay alone (CUDA events around graph.replay());
  - torch.profiler's kernel table for a few replays (top kernels by GPU time), when CUPTI works.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_decode import decode_requests, engine_step, fill_latents, measure  # noqa: E402  (the same fake requests)

from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.model.config import deepseek_v3_shaped  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", default="triton")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--model", choices=("v3-shaped", "v2-lite"), default="v3-shaped",
                   help="v2-lite: DeepSeek-V2-Lite's dims (benchmarks/e2e_model.py), --layers of them")
    p.add_argument("--moe", choices=("backend", "reference"), default="backend",
                   help="reference: the generic grouped moe op in place of the backend's")
    p.add_argument("--sequence", type=int, default=0, help="also print this many kernels of one replay, in order")
    args = p.parse_args()

    if args.model == "v2-lite":
        from e2e_model import V2_LITE

        config = {**V2_LITE, "num_hidden_layers": args.layers, "model_type": "deepseek_v2"}
    else:
        config = deepseek_v3_shaped(args.layers)
    model = DeepseekForCausalLM.from_config(config, backend=args.backend, device="cuda", dtype=torch.bfloat16)
    if args.moe == "reference":
        for layer in model.model.layers:
            if hasattr(layer.mlp, "_moe"):
                layer.mlp._moe = torch.ops.mlagraph.moe
    t0 = time.perf_counter()
    engine = Engine(model, max_num_seqs=args.batch, max_model_len=args.ctx + 16, page_size=64, compile=True,
                    cuda_graphs=True, cuda_graph_batch_sizes=[args.batch])
    print(f"engine (compile + capture): {time.perf_counter() - t0:.1f}s", flush=True)
    fill_latents(engine, seed=0)
    reqs = decode_requests(engine, args.batch, args.ctx, seed=0)
    step = measure(lambda: engine_step(engine, reqs, args.ctx), args.iters)["ms"] / 1e3

    bucket = engine.graphs.bucket_for(args.batch)
    captured = engine.graphs.graphs[(bucket, engine.graphs.methods[0])]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(args.iters):
        start.record()
        captured.graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) / 1e3)
    replay = statistics.median(replays)
    print(f"B={args.batch} ctx={args.ctx}: engine step {step * 1e3:.3f} ms | replay alone {replay * 1e3:.3f} ms | "
          f"host + copies {max(step - replay, 0) * 1e3:.3f} ms", flush=True)

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                captured.graph.replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        print(table)
        if args.sequence:
            # kernels in launch order, the last replay's first --sequence of them: what runs next to what
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels.sort(key=lambda e: e.time_range.start)
            last = kernels[-len(kernels) // 5:]
            print(f"kernel sequence of one replay ({len(last)} kernels), first {args.sequence}:")
            for e in last[:args.sequence]:
                print(f"  {e.time_range.elapsed_us():8.2f} us  {e.name[:100]}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            name = f"profile_{args.model}_{args.layers}L_moe-{args.moe}_B{args.batch}_L{args.ctx}.txt"
            with open(os.path.join(args.out, name), "w") as f:
                f.write(table)
    except Exception as e:  # CUPTI may be unavailable in a sandbox
        print(f"torch.profiler: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
