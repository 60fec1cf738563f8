"""End-to-end decode step: mlagraph's engine vs transformers' DeepseekV3ForCausalLM, same weights.

    python benchmarks/e2e_decode.py --out DIR [--only hf,eager,full,...] [--batches 1,32,128]
        [--contexts 1024,4096] [--iters 20] [--layers 2] [--device cuda] [--backend triton] [--tiny]

What: the wall time of ONE decode step (one new token for each of B requests with `ctx` tokens
cached) of a DeepSeek-V3-shaped model (mlagraph.model.config.deepseek_v3_shaped: V3's attention
and hidden dims and vocabulary, ``--layers`` layers, a small MoE), bf16 on one GPU; the median
of ``--iters`` steps after 3 warm-up steps, at every B in --batches and ctx in --contexts.

How:
- mlagraph: the step as the Engine runs it (``engine.runner.run``: host batch building, copies to
  the device, the model or its CUDA-graph replay, the final sync) over B fake requests whose
  pages hold random latents. Variants: ``eager``; ``no_passes`` (compiled, lints only);
  ``full`` (compiled + CUDA graphs, the whole stack); ``aiter`` (the same on aiter's kernels);
  the full stack with ONE part off (``ablations``): ``no_fusion``, ``no_concat_elim``,
  ``ref_decode`` (the reference decode op instead of our kernel), ``no_graphs``.
- transformers (``hf`` = ``hf_eager``, ``hf_sdpa``, ``hf_compile``): DeepseekV3ForCausalLM on the
  same tensors, run the fastest way its documentation gives: a StaticCache, eager or sdpa
  attention, and torch.compile(mode="reduce-overhead") of the faster of the two, only at
  --hf-compile-points (each compile costs GPU minutes). transformers 5 caches the same
  compressed latents (kv_lora + rope per token) and re-expands them through kv_b_proj every
  step: that is part of what is compared.

Why so:
- No prefill: caches hold random latents (a step's cost does not depend on their values), so
  B=128 x 4K fits and costs no prefill. Each timed step rewrites position ctx (HF's cache
  length counters are rewound before each step; the engine's runner does not advance ours).
- One copy of the 2.3B weights, drawn on the device: every model (transformers' too) shares
  the first one's tensors.
- Same function: before the HF variants, both models decode one small batch from the same
  cache contents and their logits are compared (``hf_check`` in the JSON; the CPU test
  asserts 1e-4 in float32).
- DIR/e2e_decode.json is rewritten after every point and variant, merged with earlier runs in
  the same file: a run cut short keeps what it measured, and runs with different ``--only``
  sets build one table (DIR/e2e_decode.md; each run prints it too).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import inspect
import json
import math
import os
import random
import statistics
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py must not shadow the `kernels` package transformers imports
from common import device_name  # noqa: E402

import mlagraph  # noqa: E402
from mlagraph.model import DeepseekConfig, DeepseekForCausalLM, Engine  # noqa: E402
from mlagraph.model.config import deepseek_v3_shaped  # noqa: E402
from mlagraph.engine import Request, SamplingParams  # noqa: E402
from mlagraph.ops import backends  # noqa: E402

PAGE_SIZE = 64
WARMUP = 3
CHECK_BATCH, CHECK_CTX = 2, 100  # the HF-vs-mlagraph check: two pages per request


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    backend: str = "base"  # "base": --backend; a backend name; "ref_decode": --backend with the reference decode
    compile: bool = False
    graphs: bool = False
    passes: tuple[str, ...] | None = None  # None: all of mlagraph's passes


HF_VARIANTS = {"hf_eager": "HF eager", "hf_sdpa": "HF sdpa", "hf_compile": "HF + torch.compile"}
VARIANTS = {
    "eager": Variant("mlagraph eager"),
    "no_passes": Variant("compiled, no passes", compile=True, passes=()),
    "full": Variant("compiled + graphs", compile=True, graphs=True),
    "aiter": Variant("compiled + graphs (aiter)", backend="aiter", compile=True, graphs=True),
    "flashmla": Variant("compiled + graphs (flashmla)", backend="flashmla", compile=True, graphs=True),
    "flashinfer": Variant("compiled + graphs (flashinfer)", backend="flashinfer", compile=True, graphs=True),
    "auto": Variant("compiled + graphs (auto)", backend="auto", compile=True, graphs=True),
    "no_fusion": Variant("- fusion", compile=True, graphs=True, passes=("eliminate_concat",)),
    "no_concat_elim": Variant("- concat elimination", compile=True, graphs=True, passes=("fuse_rope_concat_cache",)),
    "ref_decode": Variant("- our decode kernel", backend="ref_decode", compile=True, graphs=True),
    "no_graphs": Variant("- CUDA graphs", compile=True),
}
ORDER = [*HF_VARIANTS, *VARIANTS]  # run order: hf_compile compiles the faster of hf_eager / hf_sdpa
ALIASES = {"hf": list(HF_VARIANTS), "backends": ["aiter", "flashmla", "flashinfer", "auto"],
           "ablations": ["no_fusion", "no_concat_elim", "ref_decode", "no_graphs"]}


def model_config(layers: int, tiny: bool) -> dict:
    """The HF config dict: V3-shaped, or (--tiny: CPU tests, a quick GPU smoke run) small with the
    same MLA dims and 16 heads (a head count the GPU decode kernels are tested at)."""
    if not tiny:
        return deepseek_v3_shaped(layers)
    return deepseek_v3_shaped(layers, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=16,
                              num_key_value_heads=16, q_lora_rank=128, moe_intermediate_size=64)


# --- models on one set of weights ------------------------------------------------------------


def build_model(hf_cfg: dict, backend: str, device, dtype, *, like: DeepseekForCausalLM | None = None,
                std: float = 0.02) -> DeepseekForCausalLM:
    """Our model: random weights (from_config draws them on a CUDA device: seconds, not the
    minutes a CPU init of 2.3B parameters takes), or ``like``'s tensors, shared (built on the
    device too, where the throwaway default init is fast)."""
    if like is None:
        return DeepseekForCausalLM.from_config(hf_cfg, backend=backend, dtype=dtype, device=device, init_std=std)
    with torch.device(device):
        model = DeepseekForCausalLM(DeepseekConfig.from_hf(hf_cfg), backend=backend)
    unsaved = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    if unsaved != {"rope_cos_sin"}:
        raise RuntimeError(f"build_model: expected one non-persistent buffer, rope_cos_sin; got {sorted(unsaved)}")
    model.load_state_dict(like.state_dict(), strict=True, assign=True)
    model.rope_cos_sin = like.rope_cos_sin
    return model.to_device_dtype(device, dtype)  # like's tensors are there already: moves nothing


def hf_state_dict(ours: DeepseekForCausalLM, hf) -> dict[str, torch.Tensor]:
    """Our tensors under transformers' names. transformers 5 stacks routed experts as we do
    (``mlp.experts.gate_up_proj [E,2I,D]``, ``down_proj [E,D,I]``), so every name maps to itself;
    checked, so a version with other names or shapes fails here, naming them."""
    src, want = ours.state_dict(), hf.state_dict()
    problems = [f"missing in ours: {k}" for k in sorted(set(want) - set(src))]
    problems += [f"not in transformers: {k}" for k in sorted(set(src) - set(want))]
    problems += [f"{k}: ours {list(src[k].shape)}, transformers {list(want[k].shape)}"
                 for k in sorted(set(src) & set(want)) if src[k].shape != want[k].shape]
    if problems:
        raise ValueError("hf_state_dict: our parameters do not map onto transformers' DeepseekV3ForCausalLM:\n  "
                         + "\n  ".join(problems))
    return {k: src[k] for k in want}


def hf_model_like(ours: DeepseekForCausalLM, hf_cfg: dict, attn: str = "sdpa"):
    """transformers' DeepseekV3ForCausalLM on ``ours``' tensors (built on the meta device: no init)."""
    import transformers

    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_cfg))
    hf.load_state_dict(hf_state_dict(ours, hf), strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(ours.lm_head.weight.device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"hf_model_like: tensors left on the meta device: {left}")
    hf.set_attn_implementation(attn)
    return hf.eval().requires_grad_(False)


# --- transformers: a StaticCache filled without prefill, one step ----------------------------


def hf_static_cache(hf, latents: list[tuple[torch.Tensor, torch.Tensor]], max_len: int):
    """A StaticCache whose layer i holds latents[i] = (kv [B,1,S,L], k_rot [B,1,S,R]) at
    positions 0..S-1, written by the cache's own update (in transformers 5.17-5.24 it writes at
    the layer's length counter and advances it; it takes no positions)."""
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=max_len)
    for layer, (kv, k_rot) in enumerate(latents):
        cache.update(kv, k_rot, layer)
    length = latents[0][0].shape[2]
    rewind(cache, length)
    if int(cache.get_seq_length()) != length:
        raise RuntimeError(f"hf_static_cache: expected length {length}, got {int(cache.get_seq_length())}")
    return cache


def rewind(cache, length: int) -> None:
    """Sets every layer's length counter to ``length``, in place (compiled graphs hold its
    address): the next step reads positions 0..length-1 and writes position ``length``."""
    for i, layer in enumerate(cache.layers):
        counter = getattr(layer, "cumulative_length", None)
        if not isinstance(counter, torch.Tensor):
            raise RuntimeError(f"rewind: StaticCache layer {i} ({type(layer).__name__}) has no tensor "
                               f"'cumulative_length'; this benchmark knows transformers 5.17-5.24")
        counter.fill_(length)


def hf_stepper(fn, hf, cache, ids: torch.Tensor, positions: torch.Tensor):
    """() -> logits [B,V] of one step: ids [B,1] at positions [B,1] over ``cache``."""
    # transformers 5.24 calls the argument `cache` (past_key_values is deprecated); 5.17 past_key_values
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    kwargs = {"input_ids": ids, "position_ids": positions, "use_cache": True, name: cache}

    def call() -> torch.Tensor:
        with torch.no_grad():
            return fn(**kwargs).logits[:, -1]

    return call


def time_hf(fn, hf, batch: int, ctx: int, iters: int, seed: int) -> dict:
    dev, cfg, dtype = hf.lm_head.weight.device, hf.config, hf.lm_head.weight.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = torch.randn(batch, 1, ctx, cfg.kv_lora_rank, generator=g, device=dev, dtype=dtype)
    k_rot = torch.randn(batch, 1, ctx, cfg.qk_rope_head_dim, generator=g, device=dev, dtype=dtype)
    cache = hf_static_cache(hf, [(kv, k_rot)] * cfg.num_hidden_layers, ctx + 4)
    del kv, k_rot
    ids = torch.randint(cfg.vocab_size, (batch, 1), generator=g, device=dev)
    call = hf_stepper(fn, hf, cache, ids, torch.full((batch, 1), ctx, device=dev))

    def step():
        rewind(cache, ctx)
        # a new step for reduce-overhead's CUDA graphs: the previous step's outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        logits = call()
        sync(dev)
        return time.perf_counter() - t0, logits

    return measure(step, iters)


# --- mlagraph: the engine's step over fake decoding requests ----------------------------------


def decode_requests(engine: Engine, batch: int, ctx: int, seed: int) -> list[Request]:
    """``batch`` requests with ``ctx`` tokens cached (pages allocated) and one token to decode."""
    rng, reqs = random.Random(seed), []
    try:
        for i in range(batch):
            req = Request(id=i, tokens=[rng.randrange(engine.model.config.vocab_size)] * (ctx + 1),
                          prompt_len=ctx, params=SamplingParams(max_new_tokens=1))
            req.pages = engine.allocator.allocate(math.ceil((ctx + 1) / engine.page_size))
            req.num_cached = ctx
            reqs.append(req)
    except BaseException:
        release(engine, reqs)
        raise
    return reqs


def release(engine: Engine, reqs: list[Request]) -> None:
    for r in reqs:
        engine.allocator.free(r.pages)
        r.pages = []


def engine_step(engine: Engine, reqs: list[Request], ctx: int) -> tuple[float, torch.Tensor]:
    """One engine step, timed (it syncs at its end) -> (seconds, logits [B,V]). The runner
    does not advance the requests, so every step rewrites position ctx."""
    t0 = time.perf_counter()
    logits = engine.runner.run([(r, r.tokens[ctx : ctx + 1]) for r in reqs], all_logits=False)
    dt = time.perf_counter() - t0
    if logits.shape[0] != len(reqs):
        raise RuntimeError(f"engine step: expected logits for {len(reqs)} requests, got {logits.shape[0]}")
    return dt, logits.clone()  # a graph replay's output is overwritten by the next one


def time_engine(engine: Engine, batch: int, ctx: int, iters: int, seed: int) -> dict:
    reqs = decode_requests(engine, batch, ctx, seed)
    try:
        return measure(lambda: engine_step(engine, reqs, ctx), iters)
    finally:
        release(engine, reqs)


def fill_latents(engine: Engine, seed: int) -> None:
    g = torch.Generator(device=engine.device).manual_seed(seed)
    for c in engine.caches.latent:
        c.normal_(generator=g)


def ref_decode_backend(base: backends.Backend) -> backends.Backend:
    """``base`` with the reference ``mlagraph::mla_decode`` for its decode kernel. It borrows
    every op it maps, so all are declared fallbacks: it owns no op, the lints accept its graphs
    and no other backend's graph sees its ops as foreign."""
    fallbacks = {g: base.name for g, q in base.op_names.items() if not q.startswith("mlagraph::")}
    fallbacks.update(base.capabilities.fallbacks, mla_decode="reference")
    return dataclasses.replace(
        base, name=f"{base.name}_ref_decode", op_names={**base.op_names, "mla_decode": "mlagraph::mla_decode"},
        capabilities=dataclasses.replace(base.capabilities, fallbacks=fallbacks),
    )


# --- measuring ------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, iters: int) -> dict:
    """step() -> (seconds, logits). The first step (compiles, records graphs) is reported on
    its own, WARMUP - 1 more follow, then the median of ``iters``. Logits must be finite."""
    first, logits = step()
    check_finite(logits, "first step")
    for _ in range(WARMUP - 1):
        step()
    times = []
    for _ in range(iters):
        dt, logits = step()
        times.append(dt)
    check_finite(logits, "last step")
    return {"ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "iters": iters, "first_step_s": first}


def check_finite(logits: torch.Tensor, when: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"{when}: logits are not finite")


@torch.no_grad()
def hf_vs_mlagraph(ours: DeepseekForCausalLM, hf, batch: int = CHECK_BATCH, ctx: int = CHECK_CTX, seed: int = 0):
    """Both models decode one token per request from the same cache contents (our pages, their
    rope halves reordered to transformers' [evens | odds] layout); their logits compared."""
    engine = Engine(ours, max_num_seqs=batch, max_model_len=ctx + 16, page_size=PAGE_SIZE)
    fill_latents(engine, seed)
    reqs = decode_requests(engine, batch, ctx, seed)
    L, latents = ours.config.kv_lora_rank, []
    for cache in engine.caches.latent:
        rows = torch.stack([cache[r.pages].flatten(0, 1)[:ctx] for r in reqs])[:, None]  # [B,1,ctx,L+R]
        latents.append((rows[..., :L], torch.cat([rows[..., L::2], rows[..., L + 1::2]], dim=-1)))
    try:
        _, got = engine_step(engine, reqs, ctx)
    finally:
        release(engine, reqs)
    ids = torch.tensor([[r.tokens[-1]] for r in reqs], device=engine.device)
    positions = torch.full((batch, 1), ctx, device=engine.device)
    want = hf_stepper(hf, hf, hf_static_cache(hf, latents, ctx + 4), ids, positions)().float()
    return {"batch": batch, "context": ctx, "max_abs_diff": (got.float() - want).abs().max().item(),
            "max_abs_logit": want.abs().max().item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def check_text(c: dict) -> str:
    return (f"HF vs mlagraph ({c['backend']}), same cache, one step at B={c['batch']}, ctx={c['context']}: "
            f"max |diff| {c['max_abs_diff']:.3g} (max |logit| {c['max_abs_logit']:.3g}), "
            f"argmax agree {c['argmax_agree']:.2f}")


# --- running the variants ---------------------------------------------------------------------


class Models:
    """One model per backend, all on the first one's tensors, and transformers' on them too."""

    def __init__(self, hf_cfg: dict, device: torch.device, dtype: torch.dtype, std: float):
        self.hf_cfg, self.device, self.dtype, self.std = hf_cfg, device, dtype, std
        self.ours: dict[str, DeepseekForCausalLM] = {}
        self._hf = None

    def get(self, backend: str) -> DeepseekForCausalLM:
        if backend not in self.ours:
            like = next(iter(self.ours.values()), None)
            self.ours[backend] = build_model(self.hf_cfg, backend, self.device, self.dtype, like=like, std=self.std)
        return self.ours[backend]

    def hf(self):
        if self._hf is None:
            self._hf = hf_model_like(self.get(next(iter(self.ours), "reference")), self.hf_cfg)
        return self._hf


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:600]}"


def point_row(key: str, batch: int, ctx: int, device: torch.device, fn) -> dict:
    """fn() -> timings at one point; an error (OOM included) is recorded and the run goes on."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row = {"variant": key, "batch": batch, "context": ctx}
    try:
        row.update(fn())
        msg = f"{row['ms']:.3f} ms (first step {row['first_step_s']:.2f} s)"
    except Exception as e:  # noqa: BLE001
        row["error"] = error_text(e)
        msg = f"ERROR {row['error'][:300]}"
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        msg += f", peak {row['peak_gib']:.1f} GiB"
    print(f"[{key}] B={batch} ctx={ctx}: {msg}", flush=True)
    return row


def run_hf(key: str, models: Models, points, compile_points, results: Results, iters: int) -> None:
    info = {"label": HF_VARIANTS[key]}
    try:
        hf = models.hf()
        info["experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
        for batch, ctx in points:
            if key != "hf_compile":
                hf.set_attn_implementation(key.removeprefix("hf_"))
                fn = lambda: time_hf(hf, hf, batch, ctx, iters, seed=batch + ctx)  # noqa: E731
            elif (batch, ctx) in compile_points:
                attn = results.faster_hf_attention(batch, ctx)
                hf.set_attn_implementation(attn)
                fn = lambda: compiled_hf(hf, batch, ctx, iters) | {"attn": attn}  # noqa: E731
            else:
                continue
            results.add(point_row(key, batch, ctx, models.device, fn))
    except Exception as e:  # noqa: BLE001  (transformers missing, say)
        info["error"] = error_text(e)
        print(f"[{key}] ERROR {info['error']}", flush=True)
    info["peak_gib"] = results.peak(key, points)
    results.variants[key] = info


def compiled_hf(hf, batch: int, ctx: int, iters: int) -> dict:
    """torch.compile(forward, mode="reduce-overhead", fullgraph=True), else fullgraph=False."""
    fullgraph_error = None
    for fullgraph in (True, False):
        torch._dynamo.reset()  # a fresh compile for this point's shapes
        try:
            fn = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=fullgraph)
            return time_hf(fn, hf, batch, ctx, iters, seed=batch + ctx) | {
                "fullgraph": fullgraph, "fullgraph_error": fullgraph_error}
        except Exception as e:  # noqa: BLE001
            if not fullgraph or isinstance(e, torch.OutOfMemoryError):
                raise
            fullgraph_error = error_text(e)
            print(f"[hf_compile] fullgraph=True failed ({fullgraph_error[:300]}); trying fullgraph=False", flush=True)
        finally:
            fn = None
            torch._dynamo.reset()  # gives back the recorded graphs' memory


_NAMED = ("aiter", "flashmla", "flashinfer", "auto")  # variants that name their backend


def skip_reason(v: Variant, backend: str, device: torch.device) -> str | None:
    if v.graphs and device.type != "cuda":
        return "CUDA graphs need a CUDA device (the Engine raises)"
    if v.backend == "ref_decode" and backend == "reference":
        return "--backend reference already runs the reference decode"
    triton = v.backend in _NAMED or backend != "reference"
    if device.type == "cpu" and triton and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels on CPU need TRITON_INTERPRET=1 (far too slow to time)"
    return None


def engine_kwargs(v: Variant, batches: list[int], contexts: list[int]) -> dict:
    kw = dict(max_num_seqs=max(batches), max_model_len=max(contexts) + 16, page_size=PAGE_SIZE,
              compile=v.compile, cuda_graphs=v.graphs)
    # only where they mean something (so the eager variant also runs on engines without them)
    if v.compile and v.passes is not None:
        kw["compile_options"] = {"passes": v.passes}
    if v.graphs:
        kw["cuda_graph_batch_sizes"] = list(batches)
    return kw


def run_mlagraph(key: str, models: Models, base: str, batches, contexts, results: Results, iters: int) -> None:
    v = VARIANTS[key]
    reason = skip_reason(v, base, models.device)
    if reason:
        print(f"[{key}] skipped: {reason}", flush=True)
        results.variants[key] = {"label": v.label, "skipped": reason}
        return
    info = {"label": v.label, "engine_kwargs": engine_kwargs(v, batches, contexts)}
    added = engine = None
    try:
        name = v.backend if v.backend in _NAMED else base
        if v.backend == "ref_decode":
            added = backends.register(ref_decode_backend(backends.get(base)))
            name = added.name
        info["backend"] = name
        model = models.get(name)
        n_records = len(mlagraph.passes.reports())
        if models.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(models.device)
        t0 = time.perf_counter()
        engine = Engine(model, **info["engine_kwargs"])
        info["setup_s"] = time.perf_counter() - t0  # compile + capture, where the engine does them
        if models.device.type == "cuda":
            info["setup_peak_gib"] = torch.cuda.max_memory_allocated(models.device) / 2**30
        print(f"[{key}] engine built in {info['setup_s']:.1f} s", flush=True)
        fill_latents(engine, seed=0)
        for batch in batches:
            for ctx in contexts:
                fn = lambda: time_engine(engine, batch, ctx, iters, seed=batch + ctx)  # noqa: E731
                results.add(point_row(key, batch, ctx, models.device, fn))
        first = results.row(key, batches[0], contexts[0])
        if "first_step_s" in first:
            info["compile_s"] = info["setup_s"] + first["first_step_s"]  # constructor + first step
        info["pass_matches"] = {}  # compiled graph -> pass -> matches, summed over layers
        for r in mlagraph.passes.reports()[n_records:]:
            graph = info["pass_matches"].setdefault(r.graph, {})
            graph[r.pass_name] = graph.get(r.pass_name, 0) + r.count
    except Exception as e:  # noqa: BLE001
        info["error"] = error_text(e)
        print(f"[{key}] ERROR {info['error']}", flush=True)
    finally:
        engine = model = None
        if added is not None:
            models.ours.pop(added.name, None)
            backends.unregister(added.name)
        gc.collect()  # the engine's compiled steps go with it (each owns its graphs)
        if models.device.type == "cuda":
            torch.cuda.empty_cache()
    peaks = [p for p in (info.get("setup_peak_gib"), results.peak(key, [(b, c) for b in batches for c in contexts]))
             if p is not None]
    info["peak_gib"] = max(peaks, default=None)
    results.variants[key] = info


# --- results: one JSON merged across runs, markdown tables -------------------------------------


class Results:
    """DIR/e2e_decode.json: rows keyed by (variant, batch, context); the newest run wins."""

    def __init__(self, out_dir: str, meta: dict):
        self.path = os.path.join(out_dir, "e2e_decode.json")
        self.data = {"benchmark": "e2e_decode", "rows": [], "variants": {}, "runs": []}
        if os.path.exists(self.path):
            with open(self.path) as f:
                old = json.load(f)
            for k in ("config", "dtype", "device", "backend"):
                if old.get(k) != meta[k]:
                    raise ValueError(f"--out: {self.path} holds results for another {k} ({old.get(k)!r}; this run: "
                                     f"{meta[k]!r}); merging would mix them: use another --out")
            self.data.update(old)
        self.data.update(meta)
        self.data["runs"].append({k: meta[k] for k in ("date", "argv", "torch", "triton", "transformers")})
        self.variants: dict = self.data["variants"]
        os.makedirs(out_dir, exist_ok=True)

    def add(self, row: dict) -> None:
        """Adds (or replaces) a row and saves: a run killed at its time limit keeps every point."""
        self.data["rows"] = [r for r in self.data["rows"] if self._key(r) != self._key(row)] + [row]
        self.save()

    def row(self, variant: str, batch: int, ctx: int) -> dict | None:
        return next((r for r in self.data["rows"] if self._key(r) == (variant, batch, ctx)), None)

    def faster_hf_attention(self, batch: int, ctx: int) -> str:
        """"eager" or "sdpa", whichever was faster at this point (sdpa when neither was timed)."""
        rows = {k.removeprefix("hf_"): self.row(k, batch, ctx) or {} for k in ("hf_sdpa", "hf_eager")}
        timed = [(r["ms"], attn) for attn, r in rows.items() if "ms" in r]
        return min(timed)[1] if timed else "sdpa"

    def peak(self, variant: str, points) -> float | None:
        """The largest peak memory of this variant's rows at ``points`` (None off CUDA)."""
        peaks = [r["peak_gib"] for p in points if "peak_gib" in (r := self.row(variant, *p) or {})]
        return max(peaks, default=None)

    def save(self) -> None:
        self.data["rows"].sort(key=lambda r: (ORDER.index(r["variant"]), r["batch"], r["context"]))
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)  # never a half-written file

    @staticmethod
    def _key(r: dict) -> tuple:
        return r["variant"], r["batch"], r["context"]


def cell(row: dict | None, full: dict | None = None) -> str:
    """ms, then (with ``full``) the ratio to it; OOM / error / — when there is no time."""
    if row is None:
        return "—"
    if "ms" not in row:
        return "OOM" if "out of memory" in row.get("error", "").lower() else "error"
    return f"{row['ms']:.2f}" + (f" ({row['ms'] / full['ms']:.2f}x)" if full and "ms" in full else "")


def speedup(slow: dict | None, fast: dict | None) -> str:
    return f"{slow['ms'] / fast['ms']:.2f}x" if slow and fast and "ms" in slow and "ms" in fast else "—"


def best_hf(res: Results, batch: int, ctx: int) -> tuple[dict | None, str]:
    """The fastest HF sub-variant's row at this point and how it ran ("sdpa+compile", ...)."""
    rows = [(r, k) for k in HF_VARIANTS if (r := res.row(k, batch, ctx))]
    timed = [(r, k) for r, k in rows if "ms" in r]
    if not timed:
        return (rows[0][0] if rows else None), ""
    r, k = min(timed, key=lambda t: t[0]["ms"])
    return r, f"{r['attn']}+compile" if k == "hf_compile" else k.removeprefix("hf_")


def tables(res: Results) -> str:
    d, points = res.data, sorted({(r["batch"], r["context"]) for r in res.data["rows"]})
    out = [f"# Decode step, ms (median of {d['iters']}): {d['device']}, {d['dtype']}, {d['layers']} layers, "
           f"torch {d['torch']}, triton {d['triton']}, transformers {d['transformers']}, {d['date']}", ""]
    if "max_abs_diff" in d.get("hf_check", {}):
        out += [check_text(d["hf_check"]), ""]
    out += [f"| B | ctx | hf (best) | mlagraph eager | compiled, no passes | compiled + graphs ({d['backend']}) | "
            "full vs hf | full vs no passes |", "|---|---|---|---|---|---|---|---|"]
    for b, c in points:
        (hf, how), full, nop = best_hf(res, b, c), res.row("full", b, c), res.row("no_passes", b, c)
        cells = [cell(hf) + (f" ({how})" if how else ""), cell(res.row("eager", b, c)), cell(nop), cell(full),
                 speedup(hf, full), speedup(nop, full)]
        out.append(f"| {b} | {c} | " + " | ".join(cells) + " |")
    # One column per backend that ran, the whole stack (compiled + graphs) each, beside --backend's.
    others = [k for k in ALIASES["backends"] if any(r["variant"] == k for r in d["rows"])]
    if others:
        out += ["", f"Backends: compiled + graphs, ms (time vs {d['backend']}'s full stack)", "",
                f"| B | ctx | {d['backend']} | " + " | ".join(others) + " |",
                "|---|---|---|" + "---|" * len(others)]
        for b, c in points:
            full = res.row("full", b, c)
            out.append(f"| {b} | {c} | {cell(full)} | " + " | ".join(cell(res.row(k, b, c), full) for k in others) + " |")
    ablations = ALIASES["ablations"]
    out += ["", "Attribution: the full stack with one part off, ms (slowdown vs full)", "",
            "| B | ctx | full | " + " | ".join(VARIANTS[k].label for k in ablations) + " |",
            "|---|---|---|" + "---|" * len(ablations)]
    for b, c in points:
        full = res.row("full", b, c)
        cells = [cell(full)] + [cell(res.row(k, b, c), full) for k in ablations]
        out.append(f"| {b} | {c} | " + " | ".join(cells) + " |")
    out += ["", "Compile and capture: engine constructor, constructor + first step, first step at each point "
            "(B x ctx; for hf_compile the compile), seconds; peak memory (constructor or any point)", "",
            "| variant | constructor | + first step | first steps | peak GiB | note |", "|---|---|---|---|---|---|"]
    for k in (k for k in ORDER if k in d["variants"]):
        info, rows = d["variants"][k], [r for r in d["rows"] if r["variant"] == k]
        firsts = ", ".join(f"{r['first_step_s']:.1f} ({r['batch']}x{r['context']})" for r in rows if "first_step_s" in r)
        cells = [f"{info[s]:.1f}" if info.get(s) is not None else "" for s in ("setup_s", "compile_s")]
        peak = "" if info.get("peak_gib") is None else f"{info['peak_gib']:.1f}"
        cells += [firsts, peak, (info.get("skipped") or info.get("error", ""))[:120]]
        out.append(f"| {info['label']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# --- main -------------------------------------------------------------------------------------


def parse_list(text: str, name: str, item=int) -> list:
    try:
        values = sorted({item(x.strip()) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"{name}: expected a comma-separated list, got {text!r}")
    return values


def parse_point(text: str) -> tuple[int, int]:
    b, c = text.split("x")  # ValueError (caught by parse_list) unless "BxCTX"
    return int(b), int(c)


def parse_only(text: str | None) -> list[str]:
    wanted = set()
    for name in parse_list(text, "--only", str) if text else ORDER:
        if name not in ORDER and name not in ALIASES:
            raise SystemExit(f"--only: unknown variant {name!r}; known: {', '.join([*ALIASES, *ORDER])}")
        wanted.update(ALIASES.get(name, [name]))
    return [k for k in ORDER if k in wanted]


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> Results:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for e2e_decode.json / .md (merged with earlier runs)")
    p.add_argument("--only", default=None, help=f"comma list of {', '.join(ORDER)}, or {', '.join(ALIASES)}")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--hf-compile-points", default="32x1024,32x4096", help="BxCTX points where hf_compile runs")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA, else fp32")
    p.add_argument("--backend", default="triton", help="backend of every mlagraph variant but aiter")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--tiny", action="store_true", help="a small config with V3's MLA dims (CPU smoke test)")
    args = p.parse_args(argv)
    batches, contexts = parse_list(args.batches, "--batches"), parse_list(args.contexts, "--contexts")
    for name, values in (("--batches", batches), ("--contexts", contexts), ("--iters", [args.iters]),
                         ("--layers", [args.layers])):
        if min(values) < 1:
            raise SystemExit(f"{name}: expected positive ints, got {values}")
    selected = parse_only(args.only)
    compile_points = set(parse_list(args.hf_compile_points, "--hf-compile-points", parse_point))
    grid = [(b, c) for b in batches for c in contexts]
    if "hf_compile" in selected and compile_points - set(grid):
        print(f"hf_compile: {sorted(compile_points - set(grid))} are not in --batches x --contexts: skipped")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    hf_cfg = model_config(args.layers, args.tiny)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if argv is None else list(argv),
            "device": device_name(args.device), "dtype": str(dtype).removeprefix("torch."), "config": hf_cfg,
            "layers": args.layers, "iters": args.iters, "page_size": PAGE_SIZE, "backend": args.backend,
            "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers")}
    results = Results(args.out, meta)
    models = Models(hf_cfg, device, dtype, args.init_std)
    print(f"e2e decode: {meta['device']}, {meta['dtype']}, {args.layers} layers; {', '.join(selected)}", flush=True)

    if any(k in HF_VARIANTS for k in selected):
        check_backend = args.backend if skip_reason(VARIANTS["eager"], args.backend, device) is None else "reference"
        try:
            check = hf_vs_mlagraph(models.get(check_backend), models.hf()) | {"backend": check_backend}
            print(check_text(check), flush=True)
        except Exception as e:  # noqa: BLE001
            check = {"error": error_text(e)}
            print(f"HF vs mlagraph check: ERROR {check['error']}", flush=True)
        results.data["hf_check"] = check
    for key in selected:
        if key in HF_VARIANTS:
            run_hf(key, models, grid, compile_points, results, args.iters)
        else:
            run_mlagraph(key, models, args.backend, batches, contexts, results, args.iters)
        results.save()
    text = tables(results)
    print("\n" + text)
    with open(os.path.join(args.out, "e2e_decode.md"), "w") as f:
        f.write(text)
    return results


if __name__ == "__main__":
    main()
