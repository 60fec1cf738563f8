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


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def write_json(out_dir: str | None, name: str, payload: dict) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, **payload}
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(payload, f, indent=2)
