"""MTP speculative decoding: acceptance, decode tokens/s and step time, with and without it.

    python benchmarks/speculative.py --out DIR [--device cuda] [--batches 1,8,32] [--ks 1,3]
        [--new-tokens 64] [--prompt-len 32] [--layers 4] [--tiny]

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

Checked before timing: each variant's first run is compared with ``base``'s tokens. float32
on CPU: every request equal, token for token. bf16 on CUDA: the multi-token verify rounds
differently from one-token decode, so a near-tie may flip and the two sequences part there;
at the first token where a request parts, the base model scores both tokens over the common
prefix (``prompt_logprobs``) and they must be a tie within ``--tie-tol`` nats (0.1, by
arithmetic rather than measurement: with weights of std 0.02 over hidden 7168 the logits have
a standard deviation near 0.02 * sqrt(7168) = 1.7, so a draft the target did not rank first
typically sits nats below its top token). The JSON records how many requests were equal, the
mean common prefix and the largest gap. The timed run is the second.

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
    p.add_argument("--tie-tol", type=float, default=0.1,
                   help="bf16: largest base-model logprob gap allowed between the two tokens where a request parts")
    a = p.parse_args(argv)
    batches, ks = [int(x) for x in a.batches.split(",")], [int(x) for x in a.ks.split(",")]
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda and not a.tiny else torch.float32
    cfg = model_config(a.layers, a.tiny)
    backend = a.backend or ("triton" if cuda else "reference")
    model = DeepseekForCausalLM.from_config(cfg, backend=backend, dtype=dtype, device=device,
                                            init_std=0.2 if a.tiny else 0.02)
    max_len = a.prompt_len + a.new_tokens + max(ks) + 8
    common = dict(max_num_seqs=max(batches), max_model_len=max_len, page_size=16 if not a.tiny else 4,
                  cuda_graphs=cuda, progress=False)
    engines = {"base": Engine(model, **common)}
    for k in ks:
        engines[f"mtp_k{k}"] = Engine(model, speculative="mtp", num_speculative_tokens=k, **common)
    rnd = random.Random(0)
    results = {"device": device_name(str(device)), "dtype": str(dtype).removeprefix("torch."),
               "backend": model.backend.name, "layers": a.layers, "tiny": a.tiny, "prompt_len": a.prompt_len,
               "new_tokens": a.new_tokens, "points": []}
    for B in batches:
        prompts = [[rnd.randrange(cfg["vocab_size"]) for _ in range(a.prompt_len)] for _ in range(B)]
        _run(engines["base"], prompts, a.new_tokens)  # warm-up
        base, row = _run(engines["base"], prompts, a.new_tokens)
        long, _ = _run(engines["base"], prompts, a.new_tokens + max(ks))  # the oracle's drafts
        want = {tuple(pr): t for pr, t in zip(prompts, long)}
        results["points"].append({"batch": B, "variant": "base", **row})
        for k in ks:
            eng = engines[f"mtp_k{k}"]
            for name, hook in ((f"mtp_k{k}", None), (f"oracle_k{k}", _oracle(want, k))):
                eng.speculator.draft_hook = hook
                got, _ = _run(eng, prompts, a.new_tokens)  # the check, and a warm-up
                same = sum(g == b for g, b in zip(got, base))
                if dtype == torch.float32 and same < B:
                    raise RuntimeError(f"{name} at batch {B}: {same} of {B} requests equal the base run's tokens")
                parts = [next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), len(b)) for g, b in zip(got, base)]
                gap = tie_gap(engines["base"], prompts, got, base, parts)
                if gap > a.tie_tol:
                    raise RuntimeError(f"{name} at batch {B}: where a request parts from the base run, the base model "
                                       f"scores the two tokens {gap:.3f} nats apart (--tie-tol {a.tie_tol}): not a tie")
                prefix = sum(parts) / B
                _, row = _run(eng, prompts, a.new_tokens)
                results["points"].append({"batch": B, "variant": name, "equal_to_base": f"{same}/{B}",
                                          "common_prefix": round(prefix, 2), "tie_gap": round(gap, 4), **row})
                print(json.dumps(results["points"][-1]), flush=True)
            eng.speculator.draft_hook = None
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
             f"prompt {r['prompt_len']}, {r['new_tokens']} new tokens", "",
             "| batch | variant | acceptance | decode tok/s | step ms | equal to base | common prefix | tie gap |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for pt in r["points"]:
        acc = "" if pt["variant"] == "base" else f"{pt['acceptance_rate']:.3f}"
        lines.append(f"| {pt['batch']} | {pt['variant']} | {acc} | {pt['decode_tokens_per_s']} | {pt['decode_step_ms']} "
                     f"| {pt.get('equal_to_base', '')} | {pt.get('common_prefix', '')} | {pt.get('tie_gap', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
