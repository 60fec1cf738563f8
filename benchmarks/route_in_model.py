"""The triton backend's one-launch router against the generic op's torch routing, inside the
DeepSeek-V2-Lite-sized model, in one process on the same weights and prompts.

    python benchmarks/route_in_model.py --ckpt /tmp/v2lite [--prompts 1024,4096] [--batches 1,32]

``--ckpt``: a checkpoint from ``benchmarks/e2e_model.py`` (written there if missing). Prefill: the
compiled model (no graphs) runs each prompt with either router, interleaved, median of
``--iters`` each (the op's Python picks the router at each call, so one compiled graph serves
both). Decode: one engine with CUDA graphs per router (the route is captured in the graphs),
``e2e_decode.time_engine`` at each batch. Each prompt's next token is printed for both routers (they
should agree: the same experts up to exact ties); the table says how far apart they run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_decode import fill_latents, time_engine  # noqa: E402
from e2e_model import PAGE_SIZE, hf_config_dict, random_prompt, write_checkpoint  # noqa: E402

import mlagraph.ops.triton.moe as triton_moe  # noqa: E402
from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.ops.moe import route as torch_route  # noqa: E402
from mlagraph.ops.triton.route import route as triton_route  # noqa: E402

ROUTERS = {"torch": torch_route, "triton": triton_route}


def use(router: str) -> None:
    triton_moe.route = ROUTERS[router]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--prompts", default="1024,4096")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=6)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/route_in_model.py times the model on a GPU: no CUDA device here")
    device, dtype = torch.device("cuda"), torch.bfloat16
    prompts = [int(x) for x in args.prompts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        print("checkpoint:", write_checkpoint(args.ckpt, hf_config_dict(smoke=False), device, dtype), flush=True)
    model = DeepseekForCausalLM.from_pretrained(args.ckpt, backend="triton", dtype=dtype, device=device,
                                                progress=False)
    rows = []
    engine = Engine(model, max_num_seqs=1, max_model_len=max(prompts) + 16, page_size=PAGE_SIZE, compile=True,
                    cuda_graphs=False)
    for n in prompts:
        prompt = random_prompt(n, model.config.vocab_size, seed=n)
        times = {r: [] for r in ROUTERS}
        tokens = {}
        for i in range(args.iters + 1):  # the first round warms up (and compiles)
            for r in ROUTERS:
                use(r)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tokens[r] = engine.generate([prompt], max_new_tokens=1)[0].token_ids
                torch.cuda.synchronize()
                if i:
                    times[r].append(time.perf_counter() - t0)
        for r in ROUTERS:
            ms = statistics.median(times[r]) * 1e3
            rows.append((f"prefill {n}", r, ms, f"{n / ms * 1e3:.0f} tok/s"))
            print(rows[-1], flush=True)
        print(f"  same next token: {tokens['torch'] == tokens['triton']}", flush=True)
    del engine
    for r in ROUTERS:
        use(r)
        engine = Engine(model, max_num_seqs=max(batches), max_model_len=args.context + 16, page_size=PAGE_SIZE,
                        compile=True, cuda_graphs=True, cuda_graph_batch_sizes=batches)
        fill_latents(engine, seed=0)
        for b in batches:
            t = time_engine(engine, b, args.context, 20, seed=b)
            rows.append((f"decode B={b}", r, t["ms"], f"{b / t['ms'] * 1e3:.0f} tok/s"))
            print(rows[-1], flush=True)
        del engine
        torch.cuda.empty_cache()
    use("triton")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          "V2-Lite dims, bf16, triton backend")
    print("| step | router | ms | rate |\n|---|---|---|---|")
    for step, r, ms, rate in rows:
        print(f"| {step} | {r} | {ms:.2f} | {rate} |")


if __name__ == "__main__":
    main()
