"""Generate on a GPU with mlagraph: compiled step, CUDA-graph decode, tokens per second.

    python examples/generate_gpu.py                         # random DeepSeek-V3-shaped model (2 layers)
    python examples/generate_gpu.py --model DIR             # a local Hugging Face checkpoint directory
    python examples/generate_gpu.py --batch 128 --prompt-len 4096 --backend aiter

With no directory the model has DeepSeek-V3's real dimensions (hidden 7168, 128 heads, q_lora
1536, kv_lora 512, rope 64, the 129280-token vocabulary; mlagraph.model.config.deepseek_v3_shaped)
with --layers layers and a small MoE, random bf16 weights. The engine compiles its step with
mlagraph.compile, captures decode in CUDA graphs for the batch size, prefills every prompt, then
decodes; the script prints the time of each phase and decode tokens per second (warm-up and
capture excluded: a short generate runs first).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.config import deepseek_v3_shaped
from mlagraph.engine import StepStats
from mlagraph.ops import backends


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: random V3-shaped model)")
    p.add_argument("--layers", type=int, default=2, help="layers of the random model")
    p.add_argument("--backend", default="triton", help=f"one of {backends.names()}")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_ds"])
    p.add_argument("--batch", type=int, default=32, help="prompts decoded together")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("generate_gpu.py needs a CUDA GPU (examples/generate.py runs on CPU)")

    t0 = time.perf_counter()
    kw = dict(backend=args.backend, dtype=torch.bfloat16, device="cuda", kv_cache_dtype=args.kv_cache_dtype)
    if args.model:
        model = DeepseekForCausalLM.from_pretrained(args.model, **kw)
    else:
        model = DeepseekForCausalLM.from_config(deepseek_v3_shaped(args.layers), seed=args.seed, **kw)
    cfg = model.config
    print(f"model: {args.model or 'random DeepSeek-V3-shaped'} | {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, vocab {cfg.vocab_size} | backend {args.backend}, "
          f"bf16, cache {model.cache_layout} | built in {time.perf_counter() - t0:.1f}s", flush=True)

    rnd = random.Random(args.seed)
    prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    t0 = time.perf_counter()
    engine = Engine(model, max_num_seqs=args.batch, max_model_len=args.prompt_len + args.max_new_tokens,
                    page_size=64, compile=True, cuda_graphs=args.cuda_graphs,
                    cuda_graph_batch_sizes=[args.batch] if args.cuda_graphs else None,
                    prefill_chunk_size=max(8192, args.prompt_len), seed=args.seed)
    engine.generate(prompts, max_new_tokens=2)  # warm-up: compiles the prefill and decode variants
    print(f"compile + capture + warm-up: {time.perf_counter() - t0:.1f}s", flush=True)

    engine.stats = StepStats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    wall = time.perf_counter() - t0
    s = engine.stats
    for i, out in enumerate(outs[:4]):
        print(f"[{i}] {len(prompts[i])} prompt tokens -> {out.token_ids[:12]}{' ...' if len(out.token_ids) > 12 else ''}")
    print(f"prefill: {s.prefill_tokens} tokens in {s.prefill_seconds:.2f}s ({s.prefill_tokens / s.prefill_seconds:.0f} tok/s)")
    if s.decode_seconds:
        steps = s.decode_tokens / args.batch
        print(f"decode: {s.decode_tokens} tokens in {s.decode_seconds:.2f}s = {s.decode_tokens / s.decode_seconds:.0f} "
              f"tok/s ({s.decode_seconds / steps * 1e3:.2f} ms per step of {args.batch}) | wall {wall:.1f}s")


if __name__ == "__main__":
    main()
