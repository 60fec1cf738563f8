"""Shared by the benchmarks: DeepSeek-shaped configs, batches, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from mlagraph.model.batch import build_batch
from mlagraph.model.config import deepseek_v3_shaped


def deepseek_v3_config(layers: int = 4, heads: int = 16, experts: int = 8) -> dict:
    """DeepSeek-V3's attention dims (kv_lora 512, rope 64, nope 128, v 128, q_lora 1536), scaled
    down elsewhere so a few layers fit on a CPU."""
    return deepseek_v3_shaped(
        layers, vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_attention_heads=heads,
        num_key_value_heads=heads, n_routed_experts=experts, n_group=2, first_k_dense_replace=1,
        max_position_embeddings=16384,
    )


def decode_batch(model, batch_size: int, context: int, page_size: int, first_page: int = 0):
    """A decode batch: batch_size requests with `context` cached tokens each, one new token."""
    pages_per = -(-(context + 1) // page_size)
    pages = [list(range(first_page + b * pages_per, first_page + (b + 1) * pages_per)) for b in range(batch_size)]
    return build_batch(
        model.backend.capabilities, [[1]] * batch_size, [context] * batch_size, pages, page_size,
        is_decode=[True] * batch_size, dsa=model.config.uses_dsa, min_reqs=2,
        device=model.lm_head.weight.device,
    )


def median_time(fn, *, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time of fn() in seconds (synchronizing CUDA around each call)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def capture_graph(fns, repeats: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``repeats`` rounds of fns[0](), fns[1](), ...: each runs once first on
    a side stream (kernels compile, the allocator settles), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for fn in fns:
                fn()
    return graph


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of ``got`` against ``want``, in float64 on their device; inf when got
    has a non-finite value (the model benchmarks' check before a variant is timed)."""
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def write_json(out_dir: str | None, name: str, payload: dict) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, **payload}
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(payload, f, indent=2)


# DeepSeek-V3's MoE layer: 256 routed experts (top-8 of 8 groups, 4 kept), hidden 7168, expert
# intermediate 2048, sigmoid scores with noaux_tc routing.
V3_MOE = dict(dim=7168, inter=2048, experts=256, top_k=8, n_group=8, topk_group=4)
V2_LITE_MOE = dict(dim=2048, inter=1408, experts=64, top_k=6, n_group=1, topk_group=1, routing="v2-lite")


def moe_layer_args(num_tokens: int, *, dim: int, inter: int, experts: int, top_k: int, n_group: int,
                   topk_group: int, device, fp8: bool, seed: int = 0, routing: str = "v3") -> tuple:
    """torch.ops.mlagraph.moe arguments for a DeepSeek layer with random bf16 activations and
    experts ~ N(0, 1/fan_in); routing "v3" (sigmoid, noaux_tc, normalized, x2.5) or "v2-lite"
    (softmax, greedy, unnormalized, x1); fp8: e4m3 + 128x128 block scales, quantized one expert at a time
    (a float32 copy of all 256 experts would not fit). bf16 experts are the dequantized fp8
    ones, so both variants compute with the same numbers."""
    from mlagraph.ops.fp8 import dequantize_blockwise, quantize_blockwise

    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=g, device=device).bfloat16()
    logits = torch.randn(num_tokens, experts, generator=g, device=device)
    bias = torch.rand(experts, generator=g, device=device) * 0.1
    stacks = []
    for rows, cols in ((2 * inter, dim), (dim, inter)):
        q = torch.empty(experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(experts, -(-rows // 128), -(-cols // 128), device=device)
        for e in range(experts):
            q[e], s[e] = quantize_blockwise(torch.randn(rows, cols, generator=g, device=device) * cols**-0.5)
        if fp8:
            stacks.append((q, s))
        else:  # filled one expert at a time: no second full-size copy
            w = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            for e in range(experts):
                w[e] = dequantize_blockwise(q[e], s[e], torch.bfloat16)
            stacks.append((w, None))
            del q, s
    (gate_up, gu_scale), (down, d_scale) = stacks
    if routing == "v2-lite":
        return (hidden, logits, gate_up, down, None, top_k, "softmax", "greedy", n_group, topk_group, False, 1.0,
                gu_scale, d_scale)
    return (hidden, logits, gate_up, down, bias, top_k, "sigmoid", "noaux_tc", n_group, topk_group, True, 2.5,
            gu_scale, d_scale)


def moe_floor_bytes(args: tuple) -> tuple[int, int]:
    """(bytes the routed experts' weights take, of the experts this batch touches; number
    touched): the memory floor of one moe call, plus its activations in and out."""
    from mlagraph.ops.moe import route

    hidden, logits, gate_up, down = args[:4]
    _, ids = route(logits, *args[4:12])
    touched = int(torch.unique(ids).numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in (gate_up, down))
    per_expert += sum(s[0].numel() * 4 for s in args[12:] if s is not None)
    return touched * per_expert + 2 * hidden.numel() * hidden.element_size(), touched


def torch_sorted_generic(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale, num_routed,
                         first_expert=None):
    """The triton backend's prefill MoE path as it was before its blocked sort (same signature as
    ``mlagraph.ops.triton.moe.sorted_generic``): the generic op's torch sort (argsort,
    histogram, cumsum, row gather, inverse permutation) feeding the generic GEMMs and the fused
    glue."""
    from mlagraph.ops import moe as generic
    from mlagraph.ops.triton import moe_glue

    return generic.routed_grouped(hidden, weights, ids, gate_up_proj, down_proj, gate_up_scale, down_scale,
                                  num_routed, first_expert, activate=moe_glue.silu_mul,
                                  combine=moe_glue.unsort_combine)


def torch_sorted_experts(hidden, weights, ids, gate_up_proj, down_proj, first_expert=None, gate_up_scale=None,
                         down_scale=None, config=None):
    """The triton backend's sorted MoE path as it was before 2026-12-06, a peer for the one-launch
    sort (same signature as ``mlagraph.ops.triton.moe.grouped_triton``): the generic op's torch sort
    (argsort, histogram, row gather; the tile schedule per GEMM) feeding the same grouped GEMM and
    fused glue."""
    from mlagraph.ops import moe as generic
    from mlagraph.ops.triton import grouped_fp8, moe_glue

    def mm(w, scale):
        if scale is None:
            return lambda x, offs: grouped_fp8.grouped_float_mm(x, w, offs, config)
        return lambda x, offs: grouped_fp8.grouped_fp8_mm(x, w, scale, offs, config=config)

    return generic._grouped_experts(hidden, weights, ids, gate_up_proj.shape[0], mm(gate_up_proj, gate_up_scale),
                                    mm(down_proj, down_scale), first_expert=first_expert,
                                    activate=moe_glue.silu_mul, combine=moe_glue.unsort_combine)
