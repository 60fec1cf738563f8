"""Why the pair kernels run slower inside the model's decode graph than alone.

    python benchmarks/moe_in_model.py [--layers 27] [--tokens 1]

The H100 profile of a V2-Lite decode step at batch 1 (2026-12-06) has ``_gate_up_kernel`` at
48 us and ``_down_kernel`` at 26 us a layer; ``kernels.py --only moe`` times the whole op
(routing, both kernels, the combine) at 46 us a layer over 26 layers' weights. This builds the
V2-Lite-dims model and captures, over all its MoE layers, one CUDA graph per variant:
  - ``op, model weights``: the ``moe`` op on the model's own experts, one random hidden row;
  - ``op, cloned weights``: the same with each layer's experts cloned (fresh allocations);
  - ``mlp``: the layer's whole MLP (router GEMM + op + shared experts), as the model runs it;
  - ``o_proj + mlp``: each MLP preceded by the layer's o_proj GEMM (an attention-sized
    neighbour);
and prints each graph's replay time per layer and the profiler's per-kernel averages.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import capture_graph  # noqa: E402
from e2e_model import V2_LITE  # noqa: E402

from mlagraph.model import DeepseekForCausalLM  # noqa: E402
from mlagraph.model.deepseek import MoE  # noqa: E402


def call_op(mlp: MoE, x: torch.Tensor, gate_up=None, down=None) -> torch.Tensor:
    c, ex = mlp.cfg, mlp.experts
    return mlp._moe(x, mlp.gate(x), ex.gate_up_proj if gate_up is None else gate_up,
                    ex.down_proj if down is None else down, mlp.gate.e_score_correction_bias, c.num_experts_per_tok,
                    c.scoring_func, c.topk_method, c.n_group, c.topk_group, c.norm_topk_prob,
                    c.routed_scaling_factor, None, None)


def replay_us(g, n_layers: int, iters: int = 50) -> float:
    for _ in range(5):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters / n_layers


def kernel_totals(g) -> dict[str, tuple[float, int]]:
    """Kernel name -> (GPU time in us over 3 replays, calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if e.count and t:
            out[e.key[:60]] = (t, e.count)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--tokens", type=int, default=1)
    args = p.parse_args()
    config = {**V2_LITE, "num_hidden_layers": args.layers, "model_type": "deepseek_v2"}
    model = DeepseekForCausalLM.from_config(config, backend="triton", device="cuda", dtype=torch.bfloat16,
                                            init_std=0.02)
    layers = [layer for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    ex = layers[0].mlp.experts
    print(f"{torch.cuda.get_device_name()}: {len(layers)} MoE layers; gate_up {tuple(ex.gate_up_proj.shape)} "
          f"stride {ex.gate_up_proj.stride()} ptr%4096 {ex.gate_up_proj.data_ptr() % 4096}; down stride "
          f"{ex.down_proj.stride()}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(args.tokens, V2_LITE["hidden_size"], generator=g, device="cuda") * 0.5).bfloat16()
    n = len(layers)
    with torch.no_grad():
        clones = [(l.mlp.experts.gate_up_proj.clone(), l.mlp.experts.down_proj.clone()) for l in layers[:8]]
        variants = {
            "op, model weights": [lambda m=l.mlp: call_op(m, x) for l in layers],
            "op, cloned weights (8 layers)": [lambda m=l.mlp, c=c: call_op(m, x, *c) for l, c in zip(layers, clones)],
            "mlp": [lambda m=l.mlp: m(x) for l in layers],
            "o_proj + mlp": [lambda l=l: l.mlp(l.self_attn.o_proj(x)) for l in layers],
        }
        for name, fns in variants.items():
            torch.cuda.synchronize()
            gr = capture_graph(fns)
            us = replay_us(gr, len(fns))
            k = kernel_totals(gr)
            pick = {key: v for key, v in k.items() if "gate_up" in key or "down_kernel" in key}
            print(f"{name:32s} {us:7.1f} us/layer  " + "  ".join(
                f"{key.strip()[:16]} {t / c:.1f} us" for key, (t, c) in sorted(pick.items())), flush=True)
            del gr
    print("\nall kernels of the last variant (per call, us):")
    for key, (t, c) in sorted(k.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {key:60s} {t / c:8.2f} x{c}")
    print(f"(n={n})")


if __name__ == "__main__":
    main()
