"""Tensor / expert-parallel decode on one host (issue 21): the TP model against one rank, then its
CUDA-graph decode step at a few batches and contexts.

    torchrun --nproc-per-node N benchmarks/tp_decode.py --out DIR [--layers 3] [--batches 32,128]
        [--contexts 1024,4096] [--iters 20] [--ckpt DIR] [--no-fp8] [--no-check]
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/tp_decode.py --tiny --device cpu --out DIR

Model: DeepSeek-V3's attention and hidden dims with ``--layers`` layers, the first dense, the
rest with V3's real MoE (256 routed experts of 2048, top-8 in 8 groups, one shared expert),
random weights written once by rank 0 as an fp8 checkpoint (``e2e_model.write_checkpoint``),
every rank reading its slices (``from_pretrained(tensor_parallel_size=N)``: heads, widths and
vocabulary split N ways, experts by expert, fp8 weights kept fp8 with their scales).

1. Check (N > 1; ``--no-check`` skips it): rank 0 also loads the whole model on its own GPU
   (so it must fit one), and the prompt logprobs of the TP model equal it within bf16
   tolerance (the largest difference is reported; a failure stops the run).
2. Decode: an engine with compile and CUDA graphs (the collectives inside the graph), its
   latent cache filled with random values, ``batch`` requests of ``context`` cached tokens; the
   median engine step over ``--iters`` (host metadata + replay + sync), per (batch, context).

Each world size writes ``DIR/tp{N}.json``; the table printed at the end reads every
``tp*.json`` in DIR, so running N = 1 and N = 8 into the same DIR gives the scaling efficiency
(t1 / tN / N). NCCL's NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``), as the lent
multi-GPU machines require. ``--tiny``: small dims for a CPU smoke run on gloo (the test suite
runs it); its times mean nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py must not shadow `kernels`
from e2e_decode import decode_requests, engine_step, fill_latents, measure, release  # noqa: E402
from e2e_model import write_checkpoint  # noqa: E402

from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.model.config import deepseek_v3_shaped  # noqa: E402

REAL_MOE = dict(n_routed_experts=256, moe_intermediate_size=2048, num_experts_per_tok=8, n_group=8, topk_group=4,
                n_shared_experts=1, first_k_dense_replace=1)
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1)
LOGPROB_TOL = 5e-2  # bf16, summed in another order across ranks


def config_for(args) -> dict:
    return deepseek_v3_shaped(args.layers, **(TINY if args.tiny else REAL_MOE))


def prompt_logprobs(model, prompts) -> list[torch.Tensor]:
    engine = Engine(model, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + 8, page_size=64,
                    progress=False)
    out = [torch.as_tensor(lp, dtype=torch.float32) for lp in engine.prompt_logprobs(prompts)]
    del engine
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: OUT/ckpt); reused when it matches")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batches", default="32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--backend", default=None, help="default: triton on CUDA, reference on CPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-fp8", action="store_true", help="a bf16 checkpoint instead of DeepSeek's fp8 one")
    p.add_argument("--no-check", action="store_true", help="skip the logprob check against one rank")
    p.add_argument("--tiny", action="store_true", help="small dims, for a CPU smoke run")
    args = p.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda"
    args.backend = args.backend or ("triton" if cuda else "reference")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = config_for(args)
    ckpt = args.ckpt or os.path.join(args.out, "ckpt")
    os.makedirs(args.out, exist_ok=True)
    result = {"benchmark": "tp_decode", "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "layers": args.layers,
              "fp8": not args.no_fp8, "tiny": args.tiny, "rows": []}
    if rank == 0:
        result["checkpoint"] = write_checkpoint(ckpt, config, device, dtype, fp8=not args.no_fp8)
        print(f"checkpoint {ckpt}: {result['checkpoint']}", flush=True)
    if world > 1:
        dist.barrier()

    t0 = time.perf_counter()
    model = DeepseekForCausalLM.from_pretrained(ckpt, backend=args.backend, dtype=dtype, device=device,
                                                progress=False, tensor_parallel_size=world)
    result["load_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config["vocab_size"], (n,), generator=g).tolist() for n in (37, 100)]
    if not args.no_check and world > 1:
        got = prompt_logprobs(model, prompts)
        if rank == 0:
            one = DeepseekForCausalLM.from_pretrained(ckpt, backend=args.backend, dtype=dtype, device=device,
                                                      progress=False)
            want = prompt_logprobs(one, prompts)
            del one
            diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
            result["logprob_max_abs_diff_vs_one_rank"] = diff
            print(f"prompt logprobs, {world} ranks against one: max |diff| {diff:.2e} (tolerance {LOGPROB_TOL})",
                  flush=True)
            if not diff <= LOGPROB_TOL:
                raise SystemExit(f"tp_decode: the {world}-rank model's logprobs differ from one rank's by {diff}")
        dist.barrier()

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    for ctx in contexts:
        t0 = time.perf_counter()
        engine = Engine(model, max_num_seqs=max(batches), max_model_len=ctx + 16, page_size=64, compile=cuda,
                        cuda_graphs=cuda, cuda_graph_batch_sizes=batches if cuda else None, progress=False)
        setup_s = time.perf_counter() - t0
        fill_latents(engine, seed=0)
        for batch in batches:
            reqs = decode_requests(engine, batch, ctx, seed=0)
            m = measure(lambda reqs=reqs, ctx=ctx: engine_step(engine, reqs, ctx), args.iters)
            row = {"batch": batch, "context": ctx, "ms": m["ms"], "tok_s": batch / m["ms"] * 1e3, "setup_s": setup_s}
            result["rows"].append(row)
            if rank == 0:
                print(f"[tp={world}] batch {batch} ctx {ctx}: {m['ms']:.2f} ms ({row['tok_s']:.0f} tok/s)", flush=True)
            release(engine, reqs)
        del engine
    if rank == 0:
        with open(os.path.join(args.out, f"tp{world}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(table(args.out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def table(out: str) -> str:
    """Every world size measured into ``out``: step time, tokens/s and scaling efficiency against
    one rank (t1 / tN / N) where one rank was measured at the same batch and context."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "tp*.json"))):
        with open(path) as f:
            d = json.load(f)
        runs[d["world"]] = d
    if not runs:
        return ""
    one = {(r["batch"], r["context"]): r["ms"] for r in runs.get(1, {"rows": []})["rows"]}
    d0 = next(iter(runs.values()))
    dims = "tiny dims (a smoke run)" if d0["tiny"] else "V3 dims, real MoE"
    lines = [f"# TP decode: {d0['device']}, {d0['layers']} layers ({dims}), "
             f"{'fp8' if d0['fp8'] else 'bf16'} weights, torch {d0['torch']}, {d0['date']}", "",
             "| TP | batch | context | step ms | tok/s | vs TP=1 speedup | scaling efficiency | logprob diff vs 1 rank |",
             "|---|---|---|---|---|---|---|---|"]
    for world, d in sorted(runs.items()):
        for r in d["rows"]:
            base = one.get((r["batch"], r["context"]))
            speed = f"{base / r['ms']:.2f}x" if base else "—"
            eff = f"{base / r['ms'] / world:.0%}" if base else "—"
            diff = d.get("logprob_max_abs_diff_vs_one_rank")
            lines.append(f"| {world} | {r['batch']} | {r['context']} | {r['ms']:.2f} | {r['tok_s']:.0f} | {speed} | {eff} | "
                         f"{'—' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
