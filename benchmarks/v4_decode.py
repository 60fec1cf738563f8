"""DeepSeek-V4-Flash-shaped decode step: reference vs triton backend, eager / compiled / CUDA graphs.

    python benchmarks/v4_decode.py --out DIR [--batches 1,32,128] [--contexts 1024,4096]
        [--modes eager,compiled,graphs,compiled+graphs] [--backends reference,triton]
        [--no-kernels] [--tiny --device cpu]

What: the GPU time of ONE decode step (one new token for each of B requests with ``ctx`` tokens
cached) of a model with V4-Flash's attention (transformers' DeepseekV4Config defaults: 64
heads of 512 with RoPE on 64, q_lora 1024, 8 output groups of rank 1024, window 128, CSA rate
4 with a 64-head indexer of 128 and top-512, HCA rate 128, hidden 4096, hc_mult 4) and three
layers, one of each type (sliding, CSA, HCA), a small MoE (8 experts of 1024, top-6) and a 4K
vocabulary: the attention is V4-Flash's, the rest is scaled down. bf16, random weights.

How:
- No prefill: every cache (window, compressor states, compressed entries, indexer keys) holds
  random values; a step's cost does not depend on them, and B=128 x 4K then costs no prefill
  (the compressor states are the big part: ~2 GB a CSA layer). A timed step rewrites the rows
  of position ctx, always with the same values, so repeated steps are the same step.
- 1K-context batches take the dense CSA plan (every request's entries fit the top-512: the
  indexer is skipped), 4K ones the sparse plan; the ``plan`` column says which. With
  ``--plans both`` (the default) a dense point runs again with the sparse plan forced: the
  same logits (selecting all entries is a no-op), and the time the dense plan saves.
- Variants: ``<backend>/eager`` (the model called directly), ``/compiled`` (mlagraph.compile,
  Inductor, dynamic shapes: one graph per plan), ``/graphs`` and ``/compiled+graphs`` (the
  step captured in a CUDA graph and replayed). Each is checked first (a failed check is
  reported, not timed): its logits' relative error against ``reference/eager`` on the same
  caches must be within 5e-2, or, in bf16, its error against a float32 copy of the reference
  model (the same weights and caches, widened) at most twice the bf16 reference's own. The
  second rule is for CSA's top-512: two bf16 backends round the indexer scores differently and
  pick different entries where they tie, so two correct backends can be further from each
  other than either is from the float32 answer. Both errors are in the table.
  Times: the median of triton.testing.do_bench (eager, compiled) or of CUDA-graph replays.
- Kernel rows (unless --no-kernels): each new triton kernel (swa/hca/csa_decode, their
  prefill forms over one 4096-token prompt, the CSA indexer at decode, the three compressors at decode B=128 and an 8K prefill, and the fused RoPE + window write at V4's
  dims) beside the reference op's plain PyTorch, eager and under
  torch.compile, through benchmarks/kernels.py's Runner (checked before timed).

DIR/v4_decode.json and DIR/v4_decode.md are rewritten after every point, so a run cut short
keeps what it measured. ``--tiny --device cpu`` runs the same code on a tiny config (the CPU
test does; graphs and Inductor are skipped there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repo root: the kernel rows reuse the tests' case builder

from common import device_name, median_time, rel_err  # noqa: E402
from mlagraph.model import DeepseekForCausalLM  # noqa: E402
from mlagraph.model.batch import build_batch  # noqa: E402
from mlagraph.ops import v4_layouts  # noqa: E402

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
TOL = 5e-2  # relative error of bf16 logits against the bf16 reference
EXACT_RATIO = 2.0  # or: error vs float32 at most this times the bf16 reference's own (docstring)


def v4_flash_config(tiny: bool = False) -> dict:
    """V4-Flash's attention dims with three layers and a small MoE (see the module docstring)."""
    cfg = dict(model_type="deepseek_v4", vocab_size=4096, hidden_size=4096, num_hidden_layers=3,
               num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
               o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
               compress_rates={TYPES[1]: 4, TYPES[2]: 128}, hc_mult=4, moe_intermediate_size=1024,
               n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=1, layer_types=TYPES,
               mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=8192,
               rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                             "original_max_position_embeddings": 65536, "beta_fast": 32,
                                             "beta_slow": 1}})
    if tiny:
        cfg.update(vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
                   q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, index_n_heads=4,
                   index_head_dim=16, index_topk=4, compress_rates={TYPES[1]: 2, TYPES[2]: 8},
                   moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=512)
    return cfg


def decode_batch(model, batch_size: int, ctx: int, page_size: int, sparse: bool = False):
    """B requests with ctx cached tokens each (pages in order), one new token; the CSA plan from
    the config's dense limit, as the engine plans it (``sparse``: the sparse plan whatever the
    lengths, dense limit 0)."""
    per = -(-(ctx + 1) // page_size)
    pages = [list(range(b * per, (b + 1) * per)) for b in range(batch_size)]
    cfg = model.config
    return build_batch(model.backend.capabilities, [[1]] * batch_size, [ctx] * batch_size, pages, page_size,
                       is_decode=[True] * batch_size, dsa=cfg.uses_dsa,
                       dsa_dense_max_kv_len=0 if sparse else cfg.dsa_dense_max_kv_len,
                       min_reqs=2, device=model.lm_head.weight.device)


def random_caches(model, num_pages: int, page_size: int, seed: int = 0):
    """Every cache of the model filled with N(0, 1) values (the entries as normed rows would be)."""
    caches = model.allocate_caches(num_pages, page_size)
    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for c in caches:
        for t in vars(c).values():
            if t is not None:
                t.normal_(generator=g)
    return caches


def float32_copy(model):
    """The reference backend's model in float32 with ``model``'s weights (widened exactly)."""
    exact = DeepseekForCausalLM.from_config(CONFIG, backend="reference", device=model.lm_head.weight.device,
                                            dtype=torch.float32)
    exact.load_state_dict(model.state_dict())
    return exact


def widened_caches(exact, caches, num_pages: int, page_size: int):
    """``exact``'s caches holding ``caches``' values (float32 where the model's dtype shows)."""
    wide = exact.allocate_caches(num_pages, page_size)
    for w, c in zip(wide, caches):
        for name, t in vars(c).items():
            if t is not None:
                getattr(w, name).copy_(t)
    return wide


def graph_time(fn, device, replays: int = 20) -> float:
    """Seconds per replay of fn captured in a CUDA graph (median over replays)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2], out


def _variants(models, args, batch_size, ctx):
    """(backend, model, batch, plan label, mode) in run order: reference first; where the plan
    is dense, the same point again with the sparse plan forced (``--plans both``), which must
    give the same logits (top-k over entries that all fit selects them all)."""
    for backend, model in models.items():
        batch = decode_batch(model, batch_size, ctx, args.page_size)
        plans = [(batch, "dense" if batch.plan.dsa_dense else "sparse")]
        if batch.plan.dsa_dense and args.plans == "both":
            plans.append((decode_batch(model, batch_size, ctx, args.page_size, sparse=True), "sparse (forced)"))
        for b, plan in plans:
            for mode in args.modes:
                yield backend, model, b, plan, mode


def bench_point(models, compiled, caches, args, batch_size, ctx, rows, out, exact=None):
    """All variants at one (B, ctx): check against reference/eager (and ``exact``: a float32
    model with its caches, see the module docstring), then time."""
    page_size = args.page_size
    want = want32 = ref_err32 = None
    if exact is not None:
        with torch.no_grad():
            want32 = exact[0](decode_batch(exact[0], batch_size, ctx, page_size), exact[1]).clone()
    for backend, model, batch, plan, mode in _variants(models, args, batch_size, ctx):
        row = dict(batch=batch_size, context=ctx, plan=plan, variant=f"{backend}/{mode}", time_us=None,
                   error=None, error_fp32=None, note="")
        rows.append(row)
        if "graphs" in mode and model.lm_head.weight.device.type != "cuda":
            row["note"] = "skipped: CUDA graphs need a GPU"
            continue
        fn_model = compiled[backend] if mode.startswith("compiled") else model
        if fn_model is None:
            row["note"] = "skipped: not compiled here"
            continue
        step = lambda: fn_model(batch, caches)  # noqa: E731
        try:
            with torch.no_grad():
                if "graphs" in mode:
                    t, logits = graph_time(step, model.lm_head.weight.device)
                else:
                    logits = step()
                if want is None:  # reference/eager comes first
                    want = logits.clone()
                    ref_err32 = None if want32 is None else rel_err(want, want32)
                row["error"] = rel_err(logits, want)
                ok = row["error"] <= TOL
                if want32 is not None:
                    row["error_fp32"] = rel_err(logits, want32)
                    if not ok and row["error_fp32"] <= EXACT_RATIO * ref_err32:
                        ok, row["note"] = True, f"vs float32 within {EXACT_RATIO:g}x of the bf16 reference's"
                if not ok:
                    row["note"] = f"FAILED check (tol {TOL:g}" + (
                        f"; vs float32 more than {EXACT_RATIO:g}x the bf16 reference's)" if want32 is not None else ")")
                elif "graphs" in mode:
                    row["time_us"] = t * 1e6
                else:
                    row["time_us"] = median_time(step, warmup=min(3, args.iters), iters=args.iters) * 1e6
        except Exception as e:  # noqa: BLE001  (a variant that cannot run is a row with a reason)
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        t_str = f"{row['time_us']:.0f} us" if row["time_us"] else row["note"]
        print(f"B={batch_size} ctx={ctx} {plan} {row['variant']}: {t_str} (error {row['error']})", flush=True)
        save(rows, out)


# ---------------------------------------------------------------------------------------------
# kernel rows

# V4-Flash's compressors: (entry width, compress rate, overlap, entry dtype); RoPE on the last 64
COMPRESSORS = {"csa": (512, 4, True, torch.bfloat16), "hca": (512, 128, False, torch.bfloat16),
               "indexer": (128, 4, True, torch.float32)}


def compressor_case(kind: str, batch_size: int, tokens: int, ctx: int, device, *, page_size: int = 64,
                    dims=None, seed: int = 0):
    """``compressor_update`` arguments for B requests, each with ``ctx`` tokens already in a
    random state cache (no prefill needed: pooling cost does not depend on the values) and
    ``tokens`` new ones, pages in order. Returns (args, the compressed cache they write, the
    bytes the op must move: the new state rows and, per closed entry, its slots and its row)."""
    from mlagraph.ops.rope import rope_cos_sin_cache

    width, rate, overlap, entry_dtype = dims or COMPRESSORS[kind]
    rope = min(64, width // 2)
    c = 2 * width if overlap else width
    per = -(-(ctx + tokens) // page_size)
    num_pages = batch_size * per
    g = torch.Generator(device=device).manual_seed(seed)
    state = torch.randn(num_pages, page_size, 2 * c, generator=g, device=device)
    comp = torch.zeros(num_pages, v4_layouts.entries_per_page(page_size, rate), width, dtype=entry_dtype,
                       device=device)
    table = torch.arange(num_pages, dtype=torch.int32, device=device).view(batch_size, per)
    pos = (ctx + torch.arange(tokens, device=device)).repeat(batch_size)
    req = torch.arange(batch_size, dtype=torch.int32, device=device).repeat_interleave(tokens)
    slots = table.long()[req.long(), pos // page_size] * page_size + pos % page_size
    kv = torch.randn(batch_size * tokens, c, generator=g, device=device).bfloat16()
    gate = torch.randn(batch_size * tokens, c, generator=g, device=device).bfloat16()
    bias = torch.randn(rate, c, generator=g, device=device)
    norm_w = torch.rand(width, generator=g, device=device).to(entry_dtype) + 0.5
    cos_sin = rope_cos_sin_cache(rope, ctx + tokens, 160000.0, device=device)
    args = (kv, gate, bias, norm_w, cos_sin, pos, req, slots, table, state, comp, rate, overlap, 1e-6)
    closed = int(((pos + 1) % rate == 0).sum())
    slots_per_entry = 2 * rate if overlap else rate
    nbytes = batch_size * tokens * (2 * c * 2 + 2 * c * 4) + closed * (slots_per_entry * 2 * width * 4
                                                                       + width * comp.element_size())
    return args, comp, nbytes


def _ours_and_reference(K, run, op: str, args, check, result=None) -> None:
    """Times our triton ``op`` and the reference op's body, eager and under Inductor, on the
    same ``args``; ``result`` (a mutated cache) is what ``check`` reads when the op returns
    nothing."""
    body = K.reference_body("mlagraph.ops", op)
    ours = getattr(torch.ops.mlagraph_triton, op)

    def calling(fn):
        return (lambda: fn(*args)) if result is None else (lambda: (fn(*args), result)[1])

    run.run("triton", calling(ours), check)
    run.run("eager", calling(body), check)
    run.peer("inductor", lambda: calling(K.inductor(body)), check)


def bench_kernels(out_rows, args):
    """Each new kernel at V4-Flash dims beside the reference op's plain PyTorch, eager and Inductor."""
    import kernels as K
    from mlagraph.ops.rope import rope_cos_sin_cache
    from tests.ops.triton.test_swa_decode import make_case

    rows: list = []
    dev = "cuda"
    for kind, rate, topk in (("swa", 4, 1), ("hca", 128, 1), ("csa", 4, 512)):
        for batch_size in (128,):
            lens = [4096] * batch_size
            cpu_args = make_case(kind, seq_lens=lens, heads=64, dim=512, page_size=64, window=128, rate=rate,
                                 topk=topk, dtype=torch.bfloat16, seed=1)
            a = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in cpu_args]
            keys = 128 + (4096 // rate if kind == "hca" else topk if kind == "csa" else 0)
            nbytes = batch_size * (keys * 512 * 2 + 2 * 64 * 512 * 2)
            flops = batch_size * 64 * keys * 512 * 4
            run = K.Runner(rows, f"v4 {kind}_decode B={batch_size} ctx=4096", flops, nbytes, tol=2e-2)
            want = getattr(torch.ops.mlagraph, f"{kind}_decode")(*a)[0]
            _ours_and_reference(K, run, f"{kind}_decode", a, lambda o, want=want: K.rel_err(o[0], want))
            del a, want
            torch.cuda.empty_cache()
    # the prefill forms: one 4096-token prompt, every token at its own position
    from tests.ops.triton.test_sink_attention_prefill import flash_prefill

    for kind, rate, topk in (("swa", 4, 1), ("hca", 128, 1), ("csa", 4, 512)):
        cpu_args = flash_prefill(kind, [4096], torch.bfloat16, seed=3)
        a = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in cpu_args]
        p = torch.arange(4096)
        keys = (p + 1).clamp(max=128) + ((p + 1) // rate if kind == "hca" else
                                         ((p + 1) // rate).clamp(max=topk) if kind == "csa" else 0)
        flops = float(keys.sum()) * 64 * 512 * 4
        nbytes = 4096 * (2 * 64 * 512 * 2 + 512 * 2) + 4096 // rate * 512 * 2 * (kind != "swa")
        run = K.Runner(rows, f"v4 {kind}_attention prefill T=4096", flops, nbytes, tol=2e-2)
        want = getattr(torch.ops.mlagraph, f"{kind}_attention")(*a)[0]
        _ours_and_reference(K, run, f"{kind}_attention", a, lambda o, want=want: K.rel_err(o[0], want))
        del a, want
        torch.cuda.empty_cache()
    # the CSA indexer (64 heads of 128, float32 keys, top-512): decode, 128 requests of 16K tokens
    from tests.ops.triton.test_csa_indexer import flash_case

    tokens = [(b, 16383) for b in range(128)]
    cpu_args = flash_case([16384] * 128, tokens, seed=4)[:6]
    a = [x.to(dev) for x in cpu_args] + [64, 4, 512, 128**-0.5]
    nbytes = 128 * (16384 // 4) * 128 * 4 + 128 * 64 * (128 * 4 + 4) + 128 * 512 * 4
    flops = 128 * (16384 // 4) * 64 * 128 * 2
    run = K.Runner(rows, "v4 csa_indexer_topk decode B=128 ctx=16384 top-512", flops, nbytes, tol=1e-2)
    want = torch.ops.mlagraph.csa_indexer_topk(*a)
    # the same picks up to float32 near-ties: the fraction of picks not among the reference's
    check = lambda o, want=want: 1.0 - sum(float(torch.isin(o[r], want[r]).float().mean())  # noqa: E731
                                           for r in range(o.shape[0])) / o.shape[0]
    run.run("triton", lambda a=a: torch.ops.mlagraph_triton.csa_indexer_topk(*a), check)
    body = K.reference_body("compressor", "csa_indexer_topk")
    run.run("eager", lambda a=a: body(*a), check)
    del a, want
    torch.cuda.empty_cache()
    # the compressors: a decode step (B=128, every request closing a window at ctx 4096) and
    # one 8K-token prefill, for CSA's, HCA's and the indexer's compressor
    for kind in COMPRESSORS:
        for batch_size, tokens in ((128, 1), (1, 8192)):
            a, comp, nbytes = compressor_case(kind, batch_size, tokens, 4096 if tokens == 1 else 0, dev)
            torch.ops.mlagraph.compressor_update(*a)
            want = comp.clone()
            label = f"decode B={batch_size} ctx=4096" if tokens == 1 else f"prefill T={tokens}"
            run = K.Runner(rows, f"v4 {kind} compressor {label}", 0.0, nbytes, tol=1e-2)
            _ours_and_reference(K, run, "compressor_update", a, lambda o, want=want: K.rel_err(o, want), result=comp)
            del a, comp, want
            torch.cuda.empty_cache()
    # the fused front at V4's dims: q [T, 64, 448 | 64], one K=V row [448 | 64], window cache
    cos_sin = rope_cos_sin_cache(64, 8192, 10000.0, device=dev)
    for tokens in (128,):
        g = torch.Generator(device=dev).manual_seed(2)
        q = torch.randn(tokens, 64, 512, generator=g, device=dev).bfloat16()
        kv = torch.randn(tokens, 1, 512, generator=g, device=dev).bfloat16()
        cache = torch.zeros(tokens * 4 // 64 + 1, 64, 512, dtype=torch.bfloat16, device=dev)
        slots = torch.arange(tokens, device=dev) * 4
        pos = torch.arange(tokens, device=dev) * 31
        a = (q[..., :448], q[..., 448:], kv[:, 0, :448], kv[..., 448:], pos, cos_sin, cache, slots, None, "bf16",
             True)
        want = torch.ops.mlagraph.fused_rope_concat_cache_write(*a)[0]
        nbytes = tokens * (2 * 64 * 512 * 2 + 2 * 512 * 2)
        run = K.Runner(rows, f"v4 rope+window write T={tokens}", 0.0, nbytes, tol=1e-2)
        _ours_and_reference(K, run, "fused_rope_concat_cache_write", a, lambda o, want=want: K.rel_err(o[0], want))
    out_rows.extend(dict(workload=r.workload, variant=r.variant, time_us=r.time_us, error=r.error, note=r.note,
                         rate=r.rate(), floor_us=r.floor_us) for r in rows)


# ---------------------------------------------------------------------------------------------
# output


def save(rows, out, kernel_rows=()) -> None:
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    payload = {"device": device_name(str(DEVICE)), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "config": CONFIG, "steps": rows, "kernels": list(kernel_rows)}
    with open(os.path.join(out, "v4_decode.json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out, "v4_decode.md"), "w") as f:
        f.write(markdown(rows, kernel_rows))


def markdown(rows, kernel_rows=()) -> str:
    lines = [f"V4-Flash-shaped decode step (3 layers: sliding, CSA, HCA), {DTYPE}, {device_name(str(DEVICE))}, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
             "| B | ctx | plan | variant | step (us) | rel. error | vs float32 | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{r['time_us']:.0f}" if r["time_us"] else "-"
        e, e32 = (f"{r[k]:.1e}" if r.get(k) is not None else "-" for k in ("error", "error_fp32"))
        lines.append(f"| {r['batch']} | {r['context']} | {r['plan']} | {r['variant']} | {t} | {e} | {e32} | {r['note']} |")
    if kernel_rows:
        lines += ["", "| kernel workload | variant | time (us) | rate | floor (us) | note |", "|---|---|---|---|---|---|"]
        for r in kernel_rows:
            t = f"{r['time_us']:.1f}" if r["time_us"] else "-"
            lines.append(f"| {r['workload']} | {r['variant']} | {t} | {r['rate']} | {r['floor_us']:.1f} | {r['note']} |")
    return "\n".join(lines) + "\n"


DEVICE, CONFIG, DTYPE = "cuda", {}, "bfloat16"


def main(argv=None) -> None:
    global DEVICE, CONFIG, DTYPE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--modes", default="eager,compiled,graphs,compiled+graphs")
    p.add_argument("--backends", default="reference,triton")
    p.add_argument("--compile-reference", action="store_true",
                   help="also compile the reference backend (two more Inductor compiles)")
    p.add_argument("--no-kernels", dest="kernels", action="store_false")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny config (the CPU test)")
    p.add_argument("--plans", choices=["natural", "both"], default="both",
                   help="both: where a point plans dense, also time it with the sparse plan forced")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="model dtype (default: bfloat16, float32 with --tiny)")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    DEVICE, CONFIG = args.device, v4_flash_config(args.tiny)
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    backends = args.backends.split(",")
    assert backends[0] == "reference", "the reference backend comes first: every variant is checked against it"
    import mlagraph

    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.tiny else torch.bfloat16
    DTYPE = str(dtype).removeprefix("torch.")
    models, compiled = {}, {}
    for name in backends:
        # the same seed: the same weights on every backend
        models[name] = model = DeepseekForCausalLM.from_config(CONFIG, backend=name, device=args.device, dtype=dtype)
        want_compile = any(m.startswith("compiled") for m in args.modes) and args.device == "cuda"
        if want_compile and (name != "reference" or args.compile_reference):
            compiled[name] = mlagraph.compile(model, fullgraph=True, dynamic=True)
        else:
            compiled[name] = None
    page_size = args.page_size
    rate = max(CONFIG["compress_rates"].values())
    assert v4_layouts.rates_compatible(page_size, rate)
    # bf16: a float32 copy of the reference model, the yardstick of every point's check
    model32 = float32_copy(models[backends[0]]) if dtype != torch.float32 else None
    rows: list = []
    t0 = time.time()
    for ctx in contexts:
        num_pages = max(batches) * -(-(ctx + 1) // page_size)
        caches = random_caches(models[backends[0]], num_pages, page_size)
        exact = None if model32 is None else (model32, widened_caches(model32, caches, num_pages, page_size))
        for batch_size in batches:
            bench_point(models, compiled, caches, args, batch_size, ctx, rows, args.out, exact)
        del caches, exact
        if args.device == "cuda":
            torch.cuda.empty_cache()
    kernel_rows: list = []
    if args.kernels and args.device == "cuda":
        bench_kernels(kernel_rows, args)
    save(rows, args.out, kernel_rows)
    print(markdown(rows, kernel_rows))
    print(f"[{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    main()
