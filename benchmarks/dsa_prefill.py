"""DSA (V3.2) prefill: dense attention vs the sparse path (indexer + top-k + sparse MLA).

    python benchmarks/dsa_prefill.py --device cuda [--lengths 256 512 1024 2048] [--out DIR]

One V3.2 attention layer at DeepSeek's dimensions (128 heads, kv_lora 512, rope 64, q_lora 1536,
indexer 64 heads x 128, index_topk 2048; a small MLP), bf16, one prompt of each length,
prefilled once with the planner's dense variant (exact for prompts <= index_topk) and once
forced sparse. Times the whole model step (median). Runs on whatever backend is given; with
the reference backend both paths are plain PyTorch, so the ratio reflects the work each path
does in those implementations, not tuned kernels.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import deepseek_v3_config, device_name, median_time, write_json  # noqa: E402

from mlagraph.model import DeepseekForCausalLM  # noqa: E402
from mlagraph.model.batch import build_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="reference")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    cfg = deepseek_v3_config(layers=1, heads=128, experts=0)
    cfg.update(model_type="deepseek_v32", hidden_size=7168, intermediate_size=1024, n_routed_experts=0,
               index_topk=2048, index_head_dim=128, index_n_heads=64, max_position_embeddings=8192)
    model = DeepseekForCausalLM.from_config(cfg, backend=args.backend, dtype=torch.bfloat16, device=args.device)
    caps, ps = model.backend.capabilities, 64
    rows = []
    print(f"DSA prefill, 1 layer, V3.2 attention dims, bf16, backend {args.backend}, {device_name(args.device)}")
    print(f"{'tokens':>7} {'dense ms':>9} {'sparse ms':>10} {'sparse/dense':>13}")
    for n in args.lengths:
        caches = model.allocate_caches(-(-n // ps) + 1, ps)
        times = {}
        for name, limit in (("dense", n), ("sparse", 0)):
            batch = build_batch(caps, [[1 + i % 1000 for i in range(n)]], [0], [list(range(-(-n // ps)))], ps,
                                dsa=True, dsa_dense_max_kv_len=limit, device=args.device)
            with torch.no_grad():
                times[name] = median_time(lambda: model(batch, caches), warmup=1, iters=args.iters) * 1e3
        rows.append({"tokens": n, "dense_ms": times["dense"], "sparse_ms": times["sparse"],
                     "sparse_over_dense": times["sparse"] / times["dense"]})
        print(f"{n:>7} {times['dense']:>9.2f} {times['sparse']:>10.2f} {rows[-1]['sparse_over_dense']:>12.2f}x")
        del caches
    write_json(args.out, "dsa_prefill.json", {"device": device_name(args.device), "backend": args.backend, "rows": rows})


if __name__ == "__main__":
    main()
