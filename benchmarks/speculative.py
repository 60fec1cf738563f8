"""MTP speculative decoding: acceptance, decode tokens/s and step time, with and without it.

    python benchmarks/speculative.py --out DIR [--device cuda] [--batches 1,8,32] [--ks 1,3]
        [--new-tokens 64] [--prompt-len 32] [--layers 4] [--tiny] [--check float32|tie]

What, per batch size B (B requests of ``--prompt-len`` random tokens, ``--new-tokens`` greedy
tokens each, ignore_eos) and per variant:
- ``base``: the engine without speculation;
- ``mtp_k{k}``: speculative="mtp" with k drafts per step (the MTP layer with random weights:
  acceptance is low, so this is close to the worst case: each step costs a verify of k + 1
  tokens and k MTP steps for about one token);
- ``oracle_k{k}``: the same engine, its drafts replaced (after the MTP layer ran, so the
  step costs the same) by the base run's own tokens: every draft is accepted, the upper bound.
Reported: acceptance rate, decode tokens/s (generated tokens of decode steps / their wall
time) and the mean decode step time.

Checked before timing, on every variant, batch and k: greedy tokens equal the base engine's,
token for token, for every request, in float32 (``--check float32``, the default): on CPU the
timed model itself; on CUDA a float32 twin of the bf16 model (the same seed, so the same weights
before rounding) with the same engines, graphs and backend. Why not check the bf16 run itself:
the multi-token verify rounds differently from one-token decode, and in bf16 that flips not only
near-ties of the final logits but near-ties of the MoE router's top-k, which changes a token's
expert and moves its logits by up to a nat (measured on the H200, 2026-12-03: batch 8 parted
where the base model scored the two tokens 0.94 nats apart). The timed bf16 runs still report
how many requests equal the base run, their mean common prefix and the largest base-model gap
between the two tokens where a request parts (``prompt_logprobs``). ``--check tie`` gates on
that gap instead (``--tie-tol`` nats; a diagnostic, sound only without routing flips, e.g. with
``--experts-per-token`` equal to the expert count). The timed run is the second.

The model: ``mlagraph.model.config.deepseek_v3_shaped`` (V3's attention and hidden dims and
vocabulary, ``--layers`` layers, a small MoE, one MTP layer) in bf16 with CUDA graphs on CUDA;
``--tiny`` a small float32 config for the CPU smoke test. DIR/speculative.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name  # noqa: E402

from mlagraph.model import DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.model.config import deepseek_v3_shaped  # noqa: E402


def model_config(layers: int, tiny: bool) -> dict:
    if tiny:
        return deepseek_v3_shaped(layers, vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                  num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                                  qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=32,
                                  max_position_embeddings=4096, num_nextn_predict_layers=1)
    return deepseek_v3_shaped(layers, num_nextn_predict_layers=1)


def _oracle(want: dict[tuple, list[int]], k: int):
    def hook(req, drafts):
        cont = want[tuple(req.tokens[: req.prompt_len])]
        n = req.num_generated
        return (cont[n : n + k] + [0] * k)[:k]

    return hook


def tie_gap(engine: Engine, prompts, got, base, parts) -> float:
    """The largest |log p(got token) - log p(base token)| under ``engine``'s model over the
    common prefix, at each request's first differing token (0.0 when none differs)."""
    gap = 0.0
    for prompt, g, b, i in zip(prompts, got, base, parts):
        if i < min(len(g), len(b)):
            ctx = list(prompt) + b[:i]
            lp_got, lp_base = (lp[-1].item() for lp in engine.prompt_logprobs([ctx + [g[i]], ctx + [b[i]]]))
            gap = max(gap, abs(lp_got - lp_base))
    return gap


def _run(engine: Engine, prompts, new_tokens: int) -> tuple[list[list[int]], dict]:
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    wall = time.perf_counter() - t0
    s = engine.stats
    return [o.token_ids for o in outs], {
        "acceptance_rate": round(s.acceptance_rate, 4), "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
        "decode_tokens_per_s": round(s.decode_tokens / s.decode_seconds, 2) if s.decode_seconds else None,
        "decode_step_ms": round(1e3 * s.decode_seconds / s.decode_steps, 3) if s.decode_steps else None,
        "decode_steps": s.decode_steps, "wall_s": round(wall, 3),
    }


def _engines(model, ks: list[int], common: dict) -> dict[str, Engine]:
    engines = {"base": Engine(model, **common)}
    for k in ks:
        engines[f"mtp_k{k}"] = Engine(model, speculative="mtp", num_speculative_tokens=k, **common)
    return engines


def _variants(engines: dict[str, Engine], ks: list[int], prompts, new_tokens: int):
    """(name, engine, draft hook) per variant, the oracle's drafts from ``engines``' own base run."""
    long, _ = _run(engines["base"], prompts, new_tokens + max(ks))
    want = {tuple(pr): t for pr, t in zip(prompts, long)}
    for k in ks:
        yield f"mtp_k{k}", engines[f"mtp_k{k}"], None
        yield f"oracle_k{k}", engines[f"mtp_k{k}"], _oracle(want, k)


def _compare(engines, prompts, got, base) -> tuple[int, list[int], float]:
    """(requests equal to base, where each parts from it, the largest base-model gap there)."""
    same = sum(g == b for g, b in zip(got, base))
    parts = [next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), len(b)) for g, b in zip(got, base)]
    return same, parts, tie_gap(engines["base"], prompts, got, base, parts)


def _require_equal(name: str, B: int, same: int, parts: list[int], gap: float) -> None:
    if same < B:
        first = min(range(B), key=lambda i: parts[i])
        raise RuntimeError(f"{name} at batch {B}: {same} of {B} requests equal the base run's tokens in float32 "
                           f"(request {first} parts at token {parts[first]}; base-model gap there {gap:.2e} nats)")


def check(engines: dict[str, Engine], ks: list[int], prompts, new_tokens: int, B: int) -> None:
    """Every variant's greedy tokens equal the base engine's for every request (float32)."""
    base, _ = _run(engines["base"], prompts, new_tokens)
    for name, eng, hook in _variants(engines, ks, prompts, new_tokens):
        eng.speculator.draft_hook = hook
        got, _ = _run(eng, prompts, new_tokens)
        eng.speculator.draft_hook = None
        _require_equal(name, B, *_compare(engines, prompts, got, base))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="default: triton on CUDA, reference on CPU")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ks", default="1,3")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="a small float32 config (CPU smoke test)")
    p.add_argument("--experts-per-token", type=int, default=None, help="override num_experts_per_tok (8 = all)")
    p.add_argument("--check", choices=("float32", "tie"), default="float32",
                   help="float32: exact tokens on a float32 twin (default); tie: gate the timed run on --tie-tol")
    p.add_argument("--tie-tol", type=float, default=0.1,
                   help="--check tie: largest base-model logprob gap allowed between the two tokens where a request parts")
    a = p.parse_args(argv)
    batches, ks = [int(x) for x in a.batches.split(",")], [int(x) for x in a.ks.split(",")]
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda and not a.tiny else torch.float32
    cfg = model_config(a.layers, a.tiny)
    if a.experts_per_token:
        cfg["num_experts_per_tok"] = a.experts_per_token
    backend = a.backend or ("triton" if cuda else "reference")
    build = dict(backend=backend, device=device, init_std=0.2 if a.tiny else 0.02)
    model = DeepseekForCausalLM.from_config(cfg, dtype=dtype, **build)
    max_len = a.prompt_len + a.new_tokens + max(ks) + 8
    common = dict(max_num_seqs=max(batches), max_model_len=max_len, page_size=16 if not a.tiny else 4,
                  cuda_graphs=cuda, progress=False)
    engines = _engines(model, ks, common)
    # float32: the timed runs' own warm-ups are the exact check; bf16: a float32 twin is checked first
    twin = None
    if a.check == "float32" and dtype != torch.float32:
        twin = _engines(DeepseekForCausalLM.from_config(cfg, dtype=torch.float32, **build), ks, common)
    rnd = random.Random(0)
    results = {"device": device_name(str(device)), "dtype": str(dtype).removeprefix("torch."),
               "backend": model.backend.name, "layers": a.layers, "tiny": a.tiny, "prompt_len": a.prompt_len,
               "new_tokens": a.new_tokens, "experts_per_token": cfg["num_experts_per_tok"], "check": a.check,
               "points": []}
    for B in batches:
        prompts = [[rnd.randrange(cfg["vocab_size"]) for _ in range(a.prompt_len)] for _ in range(B)]
        if twin is not None:
            check(twin, ks, prompts, a.new_tokens, B)
        _run(engines["base"], prompts, a.new_tokens)  # warm-up
        base, row = _run(engines["base"], prompts, a.new_tokens)
        results["points"].append({"batch": B, "variant": "base", **row})
        for name, eng, hook in _variants(engines, ks, prompts, a.new_tokens):
            eng.speculator.draft_hook = hook
            got, _ = _run(eng, prompts, a.new_tokens)  # a warm-up, compared with base below
            same, parts, gap = _compare(engines, prompts, got, base)
            if dtype == torch.float32:
                _require_equal(name, B, same, parts, gap)
            if a.check == "tie" and gap > a.tie_tol:
                raise RuntimeError(f"{name} at batch {B}: where a request parts from the base run, the base model "
                                   f"scores the two tokens {gap:.3f} nats apart (--tie-tol {a.tie_tol}): not a tie")
            _, row = _run(eng, prompts, a.new_tokens)
            eng.speculator.draft_hook = None
            results["points"].append({"batch": B, "variant": name, "equal_to_base": f"{same}/{B}",
                                      "common_prefix": round(sum(parts) / B, 2), "tie_gap": round(gap, 4), **row})
            print(json.dumps(results["points"][-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "speculative.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = _markdown(results)
    with open(os.path.join(a.out, "speculative.md"), "w") as f:
        f.write(md)
    print(md)
    return results


def _markdown(r: dict) -> str:
    lines = [f"MTP speculative decoding, {r['device']}, {r['dtype']}, backend {r['backend']}, {r['layers']} layers, "
             f"prompt {r['prompt_len']}, {r['new_tokens']} new tokens, {r['experts_per_token']} experts per token, "
             f"checked: {r['check']}", "",
             "| batch | variant | acceptance | decode tok/s | step ms | equal to base | common prefix | tie gap |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for pt in r["points"]:
        acc = "" if pt["variant"] == "base" else f"{pt['acceptance_rate']:.3f}"
        lines.append(f"| {pt['batch']} | {pt['variant']} | {acc} | {pt['decode_tokens_per_s']} | {pt['decode_step_ms']} "
                     f"| {pt.get('equal_to_base', '')} | {pt.get('common_prefix', '')} | {pt.get('tie_gap', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
