"""The host-side planner's own time per batch (plan_batch: batch kind + DSA dense/sparse).

    python benchmarks/planner.py [--out DIR]

Times ``mlagraph.model.batch.plan_batch`` on CPU metadata for 1..256 requests (mixed prompt
chunks and decodes, kv lengths around a DSA index_topk of 2048). Goal: negligible, < 20 µs
at 256 requests. Building the device tensors (``build_batch``) is separate and not included.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, write_json  # noqa: E402

from mlagraph.model.batch import plan_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rnd = random.Random(0)
    rows = []
    print(f"plan_batch time per batch, {device_name('cpu')}")
    print(f"{'requests':>8} {'decode batch':>13} {'mixed batch':>12}")
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        prefix = [rnd.randint(0, 4096) for _ in range(n)]
        decode = ([1] * n, prefix, [True] * n)
        is_dec = [rnd.random() < 0.5 for _ in range(n)]
        mixed = ([1 if d else 512 for d in is_dec], prefix, is_dec)
        times = []
        for q_lens, prefix_lens, is_decode in (decode, mixed):
            loops = 2000
            t = timeit.timeit(lambda: plan_batch(q_lens, prefix_lens, is_decode, dsa=True, dsa_dense_max_kv_len=2048),
                              number=loops)
            times.append(t / loops * 1e6)
        rows.append({"requests": n, "decode_us": times[0], "mixed_us": times[1]})
        print(f"{n:>8} {times[0]:>11.1f}µs {times[1]:>10.1f}µs")
    write_json(args.out, "planner.json", {"device": device_name("cpu"), "rows": rows})


if __name__ == "__main__":
    main()
