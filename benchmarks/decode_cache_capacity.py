"""The compiled decode step's cost must not grow with the cache's capacity (no cache copy).

    python benchmarks/decode_cache_capacity.py [--device cpu|cuda] [--out DIR]

Times one compiled (Inductor + mlagraph passes) decode step of a DeepSeek-V3-shaped model for
the same batch over caches of 1x and 4x the pages. A functional graph that copied the cache
(a clone per layer for its in-place write) would take ~4x longer at 4x; a step that only reads
the requests' pages takes the same time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import decode_batch, deepseek_v3_config, device_name, median_time, write_json  # noqa: E402

import mlagraph  # noqa: E402
from mlagraph.model import DeepseekForCausalLM  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--pages", type=int, default=4096, help="cache pages at 1x (page size 16)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    model = DeepseekForCausalLM.from_config(deepseek_v3_config(layers=args.layers), device=args.device)
    step = mlagraph.compile(model, fullgraph=True, dynamic=True)
    rows = []
    for factor in (1, 4):
        caches = model.allocate_caches(args.pages * factor, 16)
        batch = decode_batch(model, args.batch, args.context, 16)
        mib = sum(c.numel() * c.element_size() for c in caches.latent) / 2**20
        with torch.no_grad():
            t = median_time(lambda: step(batch, caches))
        rows.append({"capacity": f"{factor}x", "cache_MiB": mib, "step_ms": t * 1e3})
        del caches
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    print(f"compiled decode step, batch {args.batch}, context {args.context}, {device_name(args.device)}")
    for r in rows:
        print(f"capacity {r['capacity']:<3} cache {r['cache_MiB']:8.0f} MiB  step {r['step_ms']:8.2f} ms")
    print(f"4x / 1x = {ratio:.2f} (a cache copy would make it ~4)")
    write_json(args.out, "decode_cache_capacity.json", {"device": device_name(args.device), "rows": rows, "ratio": ratio})


if __name__ == "__main__":
    main()
