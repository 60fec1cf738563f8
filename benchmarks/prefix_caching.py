"""Time to first token with a long shared prompt prefix, with and without prefix caching.

    python benchmarks/prefix_caching.py                      # CPU, a small V3-shaped model
    python benchmarks/prefix_caching.py --device cuda --prefix 2048 --requests 16 --out DIR

Each request is the same ``--prefix``-token prefix (a system prompt, a long document) followed
by its own ``--suffix`` tokens. Requests arrive one at a time (each is admitted, prefilled and
gives its first token before the next arrives), through the public step API; the time from
``add_request`` to the step that returns its first token is its TTFT. With prefix caching the
first request computes the prefix and fills the cache, the others reuse its full pages; every
request's first token must equal the run without caching (checked).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import device_name, write_json  # noqa: E402

from mlagraph.engine import Engine  # noqa: E402
from mlagraph.model import DeepseekForCausalLM  # noqa: E402
from mlagraph.model.config import deepseek_v3_shaped  # noqa: E402


def small_v3(max_len: int) -> dict:
    """DeepSeek-V3's attention dims (kv_lora 512, rope 64, nope 128, v 128), 2 layers, small
    elsewhere, so a 2K-token prefill takes seconds on a CPU."""
    return deepseek_v3_shaped(
        2, vocab_size=1024, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=384, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=max(4096, max_len),
    )


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the step that returns the request's one token; the token."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, max_new_tokens=1, ignore_eos=True)
    while True:
        done = engine.step()
        if done:
            assert done[0].request_id == rid
            return time.perf_counter() - t0, done[0].token_ids[0]


def run(model, prompts: list[list[int]], prefix_caching: bool, page_size: int) -> dict:
    max_len = max(map(len, prompts)) + 1
    engine = Engine(model, max_num_seqs=1, max_model_len=max_len, page_size=page_size, prefix_caching=prefix_caching)
    times, tokens = [], []
    for p in prompts:
        t, tok = time_to_first_token(engine, p)
        times.append(t)
        tokens.append(tok)
    return {
        "prefix_caching": prefix_caching,
        "first_ttft_ms": times[0] * 1e3,
        "median_ttft_ms_after_first": statistics.median(times[1:]) * 1e3,
        "cached_prompt_tokens": engine.stats.cached_prompt_tokens,
        "prompt_tokens": engine.stats.prompt_tokens,
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backend", default="reference")
    p.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    p.add_argument("--suffix", type=int, default=32, help="tokens of each request's own")
    p.add_argument("--requests", type=int, default=5, help="requests (the first one fills the cache)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for prefix_caching.json")
    args = p.parse_args()
    if args.requests < 2:
        p.error(f"--requests: expected at least 2 (the first fills the cache), got {args.requests}")

    cfg = small_v3(args.prefix + args.suffix + 1)
    model = DeepseekForCausalLM.from_config(cfg, backend=args.backend, dtype=args.dtype, device=args.device)
    rnd = random.Random(args.seed)
    prefix = [rnd.randrange(cfg["vocab_size"]) for _ in range(args.prefix)]
    prompts = [prefix + [rnd.randrange(cfg["vocab_size"]) for _ in range(args.suffix)] for _ in range(args.requests)]
    torch.set_grad_enabled(False)
    run(model, prompts[:2], False, args.page_size)  # warm-up: allocator, kernels, first-call costs
    rows = [run(model, prompts, False, args.page_size), run(model, prompts, True, args.page_size)]
    if rows[0]["tokens"] != rows[1]["tokens"]:
        raise SystemExit(f"prefix caching changed first tokens: {rows[0]['tokens']} vs {rows[1]['tokens']}")
    dev = device_name(args.device)
    print(f"{dev} | {args.backend}, {args.dtype} | prefix {args.prefix} + suffix {args.suffix} tokens, "
          f"{args.requests} requests one at a time, page {args.page_size}")
    for r in rows:
        print(f"  prefix_caching={str(r['prefix_caching']):5s}  first request TTFT {r['first_ttft_ms']:9.1f} ms | "
              f"later requests median TTFT {r['median_ttft_ms_after_first']:9.1f} ms | "
              f"cached prompt tokens {r['cached_prompt_tokens']}/{r['prompt_tokens']}")
    speedup = rows[0]["median_ttft_ms_after_first"] / rows[1]["median_ttft_ms_after_first"]
    print(f"  later requests: {speedup:.1f}x faster to first token with prefix caching (first tokens equal)")
    write_json(args.out, "prefix_caching.json", {"device": dev, "args": vars(args), "rows": rows, "speedup": speedup})


if __name__ == "__main__":
    main()
