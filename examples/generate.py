"""Compile a DeepSeek model with mlagraph and generate: a tiny random V3-shaped model, or a
checkpoint.

    python examples/generate.py                      # tiny random DeepSeek-V3-shaped model, CPU
    python examples/generate.py --model DIR          # a local Hugging Face checkpoint directory
    python examples/generate.py --arch v32 --chunk 8 # V3.2 (DSA) with chunked prefill
    python examples/generate.py --no-compile         # eager (no torch.compile)
    python examples/generate.py --model DIR --prompt "Hello" --chat   # text in and out (tokenizer.json)
    python examples/generate.py --speculative mtp --num-speculative-tokens 2   # MTP speculative decoding

Compiles the engine step with mlagraph.compile (Inductor + mlagraph's fusion passes; regional:
one graph per kind of layer block, the attention's per batch-plan variant), prints the fusions applied per layer, each request's tokens and the
prefill / decode timings (compile time excluded: a short warm-up compiles first).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.config import deepseek_v3_shaped
from mlagraph.engine import StepStats
from mlagraph.ops import backends

# DeepSeek-V3's attention dimensions (kv_lora 512, rope 64, nope 128, v 128; q_lora scaled
# down) with few heads, layers and experts, so it runs in seconds on a CPU.
TINY_V3 = deepseek_v3_shaped(
    2, vocab_size=1024, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=384, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
    max_position_embeddings=4096, num_nextn_predict_layers=1,  # an MTP layer, as DeepSeek-V3 has
)
TINY_V32 = dict(TINY_V3, model_type="deepseek_v32", index_topk=64, index_head_dim=128, index_n_heads=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: a tiny random model)")
    p.add_argument("--arch", choices=["v3", "v32"], default="v3", help="tiny random model's architecture")
    p.add_argument("--backend", default="reference",
                   help=f"one of {backends.names()} (triton on CPU: set TRITON_INTERPRET=1; slow, for checking)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_ds"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48, help="tokens per random prompt (+/- 50%%)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: whole prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="run eagerly")
    p.add_argument("--prompt", action="append", help="a text prompt (repeatable; needs --model DIR with a "
                   "tokenizer.json); default: random token-id prompts")
    p.add_argument("--chat", action="store_true", help="wrap each --prompt as a user message in the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--speculative", choices=["mtp"], default=None, help="speculative decoding with the MTP layer")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="drafts per step with --speculative (1-3)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun --nproc-per-node N)")
    args = p.parse_args()
    # Checked here, before anything is built, naming the flag.
    if args.num_prompts < 1:
        p.error(f"--num-prompts: expected a positive number of prompts, got {args.num_prompts}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens: expected a positive number of tokens, got {args.max_new_tokens}")
    if args.prompt_len < 1:
        p.error(f"--prompt-len: expected a positive number of tokens, got {args.prompt_len}")
    if args.chunk is not None and args.chunk < 1:
        p.error(f"--chunk: expected a positive prefill chunk size, got {args.chunk}")
    if args.prompt and not (args.model and os.path.isfile(os.path.join(args.model, "tokenizer.json"))):
        p.error(f"--prompt: expected --model DIR with a tokenizer.json, got --model {args.model!r}")
    if args.chat and not args.prompt:
        p.error("--chat: expected --prompt TEXT to wrap in the chat template, got no --prompt")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or args.tp != world:
        p.error(f"--tp: expected the number of torchrun ranks ({world}; torchrun --nproc-per-node N ... --tp N), "
                f"got {args.tp}")
    rank = 0
    if args.tp > 1:  # one process per rank, all running the same requests; rank 0 prints
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    say = print if rank == 0 else (lambda *a, **k: None)

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    if args.model:
        model = DeepseekForCausalLM.from_pretrained(
            args.model, backend=args.backend, dtype=dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tp,
        )
    else:
        cfg = TINY_V32 if args.arch == "v32" else TINY_V3
        model = DeepseekForCausalLM.from_config(
            cfg, backend=args.backend, dtype=dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
            seed=args.seed, tensor_parallel_size=args.tp,
        )
    cfg = model.config
    say(
        f"model: {args.model or 'tiny random ' + cfg.model_type} | {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} heads, kv_lora {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, "
        f"{cfg.n_routed_experts} experts | backend {args.backend}, {args.dtype}, cache {model.cache_layout} "
        f"{f' | tensor parallel x{args.tp}' if args.tp > 1 else ''} | built in {time.perf_counter() - t0:.2f}s"
    )

    if args.prompt:
        tok = model.tokenizer
        prompts = [[{"role": "user", "content": t}] for t in args.prompt] if args.chat else list(args.prompt)
        lens = [len(tok.encode(tok.apply_chat_template(q), add_special_tokens=False) if args.chat else tok.encode(q))
                for q in prompts]
    else:
        rnd = random.Random(args.seed)
        lens = [max(1, int(args.prompt_len * rnd.uniform(0.5, 1.5))) for _ in range(args.num_prompts)]
        prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]
    engine = Engine(
        model, max_num_seqs=len(prompts), max_model_len=max(lens) + args.max_new_tokens,
        page_size=16, prefill_chunk_size=args.chunk, seed=args.seed, compile=args.compile,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
    )
    if args.compile:
        # Warm-up on the same prompts: compiles the graphs of the plan variants this run meets
        # (prefill, chunked, decode; for V3.2 also dense / split / sparse).
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens=2, ignore_eos=True)
        fused = sorted({(r.pass_name, r.layer) for r in mlagraph.passes.reports()}, key=str)
        say(f"compiled {engine.compiled_graphs} graphs in {time.perf_counter() - t0:.1f}s "
            f"(compiling {engine.startup.compile_s:.1f}s); passes applied: "
            + ", ".join(f"{name}@layer{layer}" for name, layer in fused))
        engine.stats = StepStats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           ignore_eos=args.ignore_eos)
    wall = time.perf_counter() - t0

    for i, out in enumerate(outs):
        mean_lp = sum(out.logprobs) / len(out.logprobs)
        shown = repr(out.text) if out.text is not None else out.token_ids
        say(f"[{i}] prompt {out.prompt_len:3d} tok -> {shown}  (mean logprob {mean_lp:.3f}, {out.describe()})")
    s = engine.stats

    def rate(tokens: int, seconds: float) -> str:
        return f"{tokens} tok in {seconds * 1e3:.1f} ms ({tokens / seconds:.0f} tok/s)" if seconds else f"{tokens} tok"

    say(
        f"prefill steps: {rate(s.prefill_tokens, s.prefill_seconds)} | "
        f"decode-only steps: {rate(s.decode_tokens, s.decode_seconds)} | {s.steps} steps, wall {wall:.2f}s"
    )
    if args.speculative:
        say(f"speculative: {s.accepted_tokens} of {s.drafted_tokens} drafts accepted ({s.acceptance_rate:.1%})")
    if args.tp > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
