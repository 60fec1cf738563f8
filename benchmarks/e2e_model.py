"""DeepSeek-V2-Lite at its full published dimensions, end to end: mlagraph vs transformers, and
one DeepSeek-V3 MoE layer at full dimensions against its memory floor.

    python benchmarks/e2e_model.py --out DIR [--only ours,hf,v3_layer] [--ckpt DIR] [--prompts 1024,4096]
        [--batches 1,32,128] [--context 1024] [--tokens 1,8,32,128,256,8192] [--iters 10]
        [--backend triton] [--device cuda] [--moe-sort one-launch|torch] [--smoke]

What:
- ``ckpt``: DeepSeek-V2-Lite's config (27 layers, hidden 2048, 16 heads, kv_lora 512, no
  q_lora, 64 routed experts top-6 + 2 shared, first layer dense, vocab 102400: 15.7B
  parameters) with random weights (std 0.02) written as a real Hugging Face checkpoint: sharded
  safetensors with per-expert names, config.json, the index. Kept in --ckpt (default DIR/ckpt)
  and reused while its config matches.
- ``ours``: ``DeepseekForCausalLM.from_pretrained`` on it (--backend, bf16, compiled, CUDA graphs
  on CUDA): prefill tokens/s of one prompt of each --prompts length (``generate`` with one new
  token: the whole prefill step plus sampling), and decode tokens/s at each --batches size with
  --context tokens cached (the engine's step over fake requests whose pages hold random
  latents, as benchmarks/e2e_decode.py does), with each decode step's memory floor: the weights
  it touches (every non-expert weight, the lm_head, and the routed experts a batch of B touches
  under uniform routing, E * (1 - (1 - k/E)^B) per layer) plus the latent cache it reads, at
  4.25 TB/s (ANCHORS.md).
- ``hf``: transformers' ``DeepseekV2ForCausalLM.from_pretrained`` on the same checkpoint (sdpa,
  bf16): prefill with ``logits_to_keep=1``; decode over a DynamicCache filled by a real prefill
  of B x context random tokens and cropped back to ``context`` before every timed step. Before
  timing, both models' logprobs of one prompt are compared (``check`` in the JSON).
- ``v3_layer``: the --backend's ``moe`` op at DeepSeek-V3's MoE dims (256 experts, hidden 7168,
  intermediate 2048, top-8 noaux_tc), bf16 and fp8 experts (the same numbers), at each
  --tokens count, checked against the all-experts oracle, timed over CUDA-graph replays, next
  to its floor: the bytes of the experts the batch touches at 4.25 TB/s, or its FLOPs at
  690 TFLOP/s (bf16 GEMM, ANCHORS.md), whichever is larger.

--moe-sort torch: the triton backend's sorted MoE paths fed by the generic op's torch sort, as
they were before 2026-12-06 (``common.torch_sorted_experts`` for decode-sized batches,
``common.torch_sorted_generic`` for prefill), so a second run into another --out on the same
machine measures what our sort changed end to end.

--smoke: tiny dims (2 layers, hidden 128, 8 experts) on --device cpu in float32, a few
iterations: CI proves the script runs (tests/test_e2e_model_bench.py); its numbers mean nothing.
DIR/e2e_model.json holds every row (a run of some --only parts replaces those parts' rows and
keeps the others', so parts can run in separate calls); the tables are printed and written to
DIR/e2e_model.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py must not shadow the `kernels` package transformers imports
from common import V3_MOE, device_name, median_time, moe_floor_bytes, moe_layer_args  # noqa: E402
from e2e_decode import fill_latents, time_engine, version  # noqa: E402

from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.ops.moe import moe_all_experts  # noqa: E402

PEAK_FLOPS, PEAK_BYTES = 690e12, 4.25e12  # bf16 GEMM, device copy on the H200 (ANCHORS.md)
PAGE_SIZE = 64
SHARD_BYTES = 4 << 30
PARTS = ("ours", "hf", "v3_layer")

V2_LITE = dict(  # deepseek-ai/DeepSeek-V2-Lite's config.json
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1,
    norm_topk_prob=False, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    initializer_range=0.02, attention_bias=False, bos_token_id=100000, eos_token_id=100001,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                     "mscale_all_dim": 0.707},
)
SMOKE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=64, qk_rope_head_dim=16,
             qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=5120, bos_token_id=0, eos_token_id=1,
             rope_parameters={**V2_LITE["rope_parameters"], "original_max_position_embeddings": 128})
SMOKE_V3_MOE = dict(dim=256, inter=128, experts=16, top_k=4, n_group=4, topk_group=2)


def hf_config_dict(smoke: bool) -> dict:
    """The config.json contents (transformers' own DeepseekV2Config spelling, so both load it)."""
    import transformers

    cfg = transformers.DeepseekV2Config(**{**V2_LITE, **(SMOKE if smoke else {})})
    return {**cfg.to_dict(), "architectures": ["DeepseekV2ForCausalLM"]}


# --- the checkpoint ---------------------------------------------------------------------------


def hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under a real DeepSeek checkpoint's names: routed experts one per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('.down_proj')}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


# DeepSeek's fp8 checkpoints: e4m3 weights with a float32 scale per 128x128 block, except these
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score", "rotary")


def write_checkpoint(path: str, config: dict, device: torch.device, dtype: torch.dtype, fp8: bool = False) -> dict:
    """Random weights as a sharded Hugging Face checkpoint at ``path`` (kept while config
    matches). ``fp8``: every 2-d linear and expert weight as DeepSeek stores it (e4m3 +
    ``weight_scale_inv`` per 128x128 block, ``quantization_config`` in config.json)."""
    from safetensors.torch import save_file

    from mlagraph.ops.fp8 import quantize_blockwise

    on_disk = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    if fp8:
        on_disk["quantization_config"] = FP8_QUANTIZATION
    marker = os.path.join(path, "config.json")
    if os.path.exists(marker) and os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        with open(marker) as f:
            if json.load(f) == json.loads(json.dumps(on_disk)):
                return {"reused": True}
    t0 = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    model = DeepseekForCausalLM.from_config(config, dtype=dtype, device=device, init_std=config["initializer_range"])
    tensors = hf_names(model.state_dict())
    weight_map, shard, size, n = {}, {}, 0, 0
    names = sorted(tensors)
    for i, name in enumerate(names):
        t = tensors[name]
        if fp8 and t.dim() == 2 and not any(part in name for part in NOT_QUANTIZED):
            q, scale = quantize_blockwise(t.float())
            shard[name], shard[name + "_scale_inv"] = q.cpu(), scale.cpu()
        else:
            shard[name] = t.contiguous().cpu()
        size += sum(shard[k].numel() * shard[k].element_size() for k in (name, name + "_scale_inv") if k in shard)
        if size >= SHARD_BYTES or i == len(names) - 1:
            n += 1
            file = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update((k, file) for k in shard)
            shard, size = {}, 0
    params = sum(p.numel() for p in model.parameters())
    del model, tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_parameters": params}, "weight_map": weight_map}, f)
    with open(marker, "w") as f:  # last: a half-written checkpoint is never reused
        json.dump(on_disk, f)
    return {"reused": False, "write_s": time.perf_counter() - t0, "parameters": params, "shards": n}


# --- floors -----------------------------------------------------------------------------------


def decode_floor_ms(model: DeepseekForCausalLM, batch: int, context: int) -> float:
    """Bytes a decode step must read at best (see the module docstring) at 4.25 TB/s, in ms."""
    c, nbytes = model.config, 0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        if "mlp.experts." in name:  # routed experts: the expected share a batch touches
            size *= 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch
        elif "embed_tokens" in name:
            size = batch * c.hidden_size * t.element_size()
        nbytes += size
    nbytes += c.num_hidden_layers * batch * context * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    return nbytes / PEAK_BYTES * 1e3


# --- mlagraph ---------------------------------------------------------------------------------


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n,), generator=g).tolist()


def run_ours(args, ckpt: str, device, dtype, rows: list, meta: dict) -> DeepseekForCausalLM:
    cuda = device.type == "cuda"
    if args.moe_sort == "torch":  # every later call of the op (capture included) takes the old sort
        from common import torch_sorted_experts, torch_sorted_generic

        import mlagraph.ops.triton.moe as triton_moe

        triton_moe.grouped_triton = torch_sorted_experts
        triton_moe.sorted_generic = torch_sorted_generic
    t0 = time.perf_counter()
    model = DeepseekForCausalLM.from_pretrained(ckpt, backend=args.backend, dtype=dtype, device=device, progress=False)
    meta["ours_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = Engine(model, max_num_seqs=max(args.batches), max_model_len=max(*args.prompts, args.context) + 16,
                    page_size=PAGE_SIZE, compile=args.compile, cuda_graphs=cuda,
                    cuda_graph_batch_sizes=args.batches if cuda else None)
    meta["ours_setup_s"] = time.perf_counter() - t0  # compile + capture
    vocab = model.config.vocab_size
    for n in args.prompts:
        prompt = random_prompt(n, vocab, seed=n)
        s = median_time(lambda: engine.generate([prompt], max_new_tokens=1), warmup=1, iters=args.iters)
        rows.append({"part": "ours", "kind": "prefill", "tokens": n, "ms": s * 1e3, "tok_s": n / s})
        print(f"[ours] prefill {n}: {s * 1e3:.1f} ms, {n / s:.0f} tok/s", flush=True)
    fill_latents(engine, seed=0)
    for b in args.batches:
        t = time_engine(engine, b, args.context, args.iters, seed=b)
        floor = decode_floor_ms(model, b, args.context)
        rows.append({"part": "ours", "kind": "decode", "batch": b, "context": args.context, "ms": t["ms"],
                     "tok_s": b / t["ms"] * 1e3, "floor_ms": floor, "first_step_s": t["first_step_s"]})
        print(f"[ours] decode B={b}: {t['ms']:.2f} ms ({b / t['ms'] * 1e3:.0f} tok/s), floor {floor:.2f} ms",
              flush=True)
    del engine
    return model


# --- transformers -----------------------------------------------------------------------------


def load_hf(ckpt: str, device, dtype):
    import transformers

    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa")
    return hf.to(device).eval().requires_grad_(False)


def _cache_kw(hf, cache) -> dict:
    # transformers 5.24 calls the argument `cache` (past_key_values is deprecated); 5.17 past_key_values
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {name: cache}


@torch.no_grad()
def run_hf(args, hf, device, rows: list) -> None:
    from transformers import DynamicCache

    vocab = hf.config.vocab_size
    for n in args.prompts:
        ids = torch.tensor([random_prompt(n, vocab, seed=n)], device=device)
        s = median_time(lambda: hf(input_ids=ids, logits_to_keep=1), warmup=1, iters=args.iters)
        rows.append({"part": "hf", "kind": "prefill", "tokens": n, "ms": s * 1e3, "tok_s": n / s})
        print(f"[hf] prefill {n}: {s * 1e3:.1f} ms, {n / s:.0f} tok/s", flush=True)
    ctx = args.context
    for b in args.batches:
        row = {"part": "hf", "kind": "decode", "batch": b, "context": ctx}
        try:
            g = torch.Generator(device=device).manual_seed(b)
            cache = DynamicCache(config=hf.config)
            hf(input_ids=torch.randint(vocab, (b, ctx), generator=g, device=device), use_cache=True,
               logits_to_keep=1, **_cache_kw(hf, cache))
            step_ids = torch.randint(vocab, (b, 1), generator=g, device=device)
            positions = torch.full((b, 1), ctx, device=device)

            def step():
                extra = cache.get_seq_length() - ctx  # the previous step's token
                if extra > 0:
                    cache.crop(-extra)
                hf(input_ids=step_ids, position_ids=positions, use_cache=True, **_cache_kw(hf, cache))

            s = median_time(step, warmup=1, iters=args.iters)
            row.update(ms=s * 1e3, tok_s=b / s)
            print(f"[hf] decode B={b}: {s * 1e3:.2f} ms ({b / s:.0f} tok/s)", flush=True)
        except torch.OutOfMemoryError as e:
            row["error"] = f"OutOfMemoryError: {str(e)[:200]}"
            print(f"[hf] decode B={b}: {row['error']}", flush=True)
        finally:
            cache = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)


@torch.no_grad()
def logprob_check(ours: DeepseekForCausalLM, hf, n: int = 64) -> dict:
    """Both models' log p(tok_t | tok_<t) of one random prompt."""
    ids = random_prompt(n, ours.config.vocab_size, seed=7)
    got = Engine(ours, max_num_seqs=1, max_model_len=n + 16, page_size=PAGE_SIZE).prompt_logprobs([ids])[0].float()
    t = torch.tensor([ids], device=hf.lm_head.weight.device)
    want = hf(input_ids=t).logits[0, :-1].float().log_softmax(-1).gather(1, t[0, 1:, None])[:, 0].cpu()
    return {"tokens": n, "max_abs_diff": (got.cpu() - want).abs().max().item(), "mean_logprob": want.mean().item()}


# --- one DeepSeek-V3 MoE layer ----------------------------------------------------------------


def time_call(fn, device, iters: int) -> float:
    """Seconds per call: CUDA-graph replays timed with events on CUDA, wall time elsewhere."""
    if device.type != "cuda":
        return median_time(fn, warmup=1, iters=iters)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def run_v3_layer(args, device, rows: list) -> None:
    from mlagraph.ops import backends

    # the --backend's moe, as the model runs it (triton: its pair kernels at decode sizes)
    moe_op = backends.get(args.backend, device.type).op("moe")
    dims = SMOKE_V3_MOE if args.smoke else V3_MOE
    flops_per_token = 2 * dims["top_k"] * 3 * dims["dim"] * dims["inter"]
    for fp8 in (False, True):
        label = "fp8" if fp8 else "bf16"
        base = moe_layer_args(max(args.tokens), device=device, fp8=fp8, **dims)
        for n in args.tokens:
            a = (base[0][:n], base[1][:n], *base[2:])
            nbytes, touched = moe_floor_bytes(a)
            floor = max(nbytes / PEAK_BYTES, n * flops_per_token / PEAK_FLOPS)
            row = {"part": "v3_layer", "experts": label, "tokens": n, "touched_experts": touched,
                   "floor_ms": floor * 1e3}
            try:
                out = moe_op(*a)
                if n <= args.check_tokens:  # the oracle runs all 256 experts on every token
                    want = moe_all_experts(*a).float()
                    row["rel_err"] = ((out.float() - want).norm() / want.norm()).item()
                s = time_call(lambda: moe_op(*a), device, args.iters)
                row.update(ms=s * 1e3, floor_ratio=s / floor)
                print(f"[v3_layer] {label} T={n}: {s * 1e3:.3f} ms, floor {floor * 1e3:.3f} ms ({touched} experts), "
                      f"rel err {row.get('rel_err', float('nan')):.2e}", flush=True)
            except torch.OutOfMemoryError as e:
                row["error"] = f"OutOfMemoryError: {str(e)[:200]}"
                print(f"[v3_layer] {label} T={n}: {row['error']}", flush=True)
            rows.append(row)
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- tables and main --------------------------------------------------------------------------


def tables(data: dict) -> str:
    rows = data["rows"]

    def get(part, **kw):
        return next((r for r in rows if r["part"] == part and all(r.get(k) == v for k, v in kw.items())), {})

    def num(r, key, fmt):
        return format(r[key], fmt) if key in r else r.get("error", "—")[:40]

    out = [f"# {data['model']}: {data['device']}, {data['dtype']}, backend {data['backend']}, torch {data['torch']}, "
           f"transformers {data['transformers']}, {data['date']}"
           + ("" if data.get("moe_sort", "one-launch") == "one-launch" else ", MoE sorted by torch (as before 12-06)"), ""]
    if "check" in data:
        out += [f"logprobs, mlagraph vs transformers, {data['check']['tokens']} tokens: max |diff| "
                f"{data['check']['max_abs_diff']:.3g}", ""]
    out += ["| prefill tokens | mlagraph tok/s | transformers tok/s | speedup |", "|---|---|---|---|"]
    for n in data["prompts"]:
        o, h = get("ours", kind="prefill", tokens=n), get("hf", kind="prefill", tokens=n)
        sp = f"{o['tok_s'] / h['tok_s']:.1f}x" if "tok_s" in o and "tok_s" in h else "—"
        out.append(f"| {n} | {num(o, 'tok_s', '.0f')} | {num(h, 'tok_s', '.0f')} | {sp} |")
    out += ["", f"| decode batch (ctx {data['context']}) | mlagraph ms | tok/s | floor ms | vs floor | "
            "transformers ms | tok/s | speedup |", "|---|---|---|---|---|---|---|---|"]
    for b in data["batches"]:
        o, h = get("ours", kind="decode", batch=b), get("hf", kind="decode", batch=b)
        vs = f"{o['ms'] / o['floor_ms']:.2f}x" if "ms" in o else "—"
        sp = f"{h['ms'] / o['ms']:.1f}x" if "ms" in o and "ms" in h else "—"
        out.append(f"| {b} | {num(o, 'ms', '.2f')} | {num(o, 'tok_s', '.0f')} | {num(o, 'floor_ms', '.2f')} | {vs} | "
                   f"{num(h, 'ms', '.2f')} | {num(h, 'tok_s', '.0f')} | {sp} |")
    out += ["", "| V3 MoE layer tokens | experts | touched | ms | floor ms | vs floor | rel err vs oracle |",
            "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "v3_layer"):
        vs = f"{r['floor_ratio']:.2f}x" if "floor_ratio" in r else "—"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "—"
        out.append(f"| {r['tokens']} | {r['experts']} | {r['touched_experts']} | {num(r, 'ms', '.3f')} | "
                   f"{r['floor_ms']:.3f} | {vs} | {err} |")
    return "\n".join(out) + "\n"


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{name}: expected a comma-separated list of positive ints, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: OUT/ckpt); reused when it matches")
    p.add_argument("--prompts", default="1024,4096")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", default="1,8,32,128,256,8192", help="V3 MoE layer token counts")
    p.add_argument("--check-tokens", type=int, default=8192, help="check the V3 layer against the oracle up to here")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--moe-sort", choices=("one-launch", "torch"), default="one-launch",
                   help="triton backend: the sorted MoE paths' sort (torch: as before 2026-12-06)")
    p.add_argument("--smoke", action="store_true", help="tiny dims on CPU in float32 (CI: the script runs)")
    args = p.parse_args(argv)
    only = [x for x in args.only.split(",") if x]
    if unknown := [x for x in only if x not in PARTS]:
        raise SystemExit(f"--only: unknown {unknown}; known: {', '.join(PARTS)}")
    args.prompts, args.batches = parse_ints(args.prompts, "--prompts"), parse_ints(args.batches, "--batches")
    args.tokens = parse_ints(args.tokens, "--tokens")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        args.compile = False  # Inductor on CPU would time the compiler, not the model
    config = hf_config_dict(args.smoke)
    data = {"benchmark": "e2e_model", "model": "DeepSeek-V2-Lite dims" + (" (smoke: tiny)" if args.smoke else ""),
            "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if argv is None else list(argv),
            "device": device_name(args.device), "dtype": str(dtype).removeprefix("torch."), "backend": args.backend,
            "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
            "prompts": args.prompts, "batches": args.batches, "context": args.context, "moe_sort": args.moe_sort,
            "rows": []}
    ckpt = args.ckpt or os.path.join(args.out, "ckpt")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "e2e_model.json")
    if os.path.exists(path):  # parts run in separate calls build one file: keep the other parts' rows
        with open(path) as f:
            old = json.load(f)
        if old.get("model") == data["model"] and old.get("device") == data["device"]:
            data["rows"] = [r for r in old["rows"] if r["part"] not in only]
            data.update({k: old[k] for k in ("check", "ours_load_s", "ours_setup_s") if k in old and "hf" not in only})

    def save():
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    ours = None
    if "ours" in only or "hf" in only:
        data["checkpoint"] = write_checkpoint(ckpt, config, device, dtype)
        print(f"checkpoint {ckpt}: {data['checkpoint']}", flush=True)
    if "ours" in only:
        ours = run_ours(args, ckpt, device, dtype, data["rows"], data)
        save()
    if "hf" in only:
        if ours is None:  # for the check only: eager, no engine of its own
            ours = DeepseekForCausalLM.from_pretrained(ckpt, backend=args.backend, dtype=dtype, device=device,
                                                       progress=False)
        hf = load_hf(ckpt, device, dtype)
        data["check"] = logprob_check(ours, hf)
        print(f"check: {data['check']}", flush=True)
        ours = None
        run_hf(args, hf, device, data["rows"])
        del hf
        save()
    ours = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "v3_layer" in only:
        run_v3_layer(args, device, data["rows"])
        save()
    text = tables(data)
    print("\n" + text)
    with open(os.path.join(args.out, "e2e_model.md"), "w") as f:
        f.write(text)
    return data


if __name__ == "__main__":
    main()
