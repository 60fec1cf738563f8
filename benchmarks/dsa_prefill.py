"""DSA (V3.2) prefill, dense attention against the sparse path (indexer + top-k + sparse MLA),
per backend, with and without a cached prefix: where does sparse beat dense?

    python benchmarks/dsa_prefill.py --device cuda --out DIR      # the H200 run (defaults below)
    python benchmarks/dsa_prefill.py --device cpu --tiny          # CPU smoke run, ~20 s

Defaults: ``--backends triton flashmla`` (flashmla needs the sgl-flash-mla wheel and an sm_90
GPU), ``--lengths 1024 2048 4096 8192 16384 32768`` (new tokens N), ``--prefixes 0 8192``
(cached tokens P), ``--layers 1``, ``--iters 5`` after ``--warmup 1``, ``--page-size 64``,
``--ref-max-gib 24``, bf16. A backend the machine cannot run is listed as skipped with the
library's reason (not installed, wrong GPU, ...); a point that runs out of memory is a row with
that note.

Model: ``--layers`` V3.2 layers at DeepSeek's dims (hidden 7168, 128 heads, q_lora 1536,
kv_lora 512, rope 64, nope 128, v 128; indexer 64 heads x 128, index_topk 2048; YaRN over
163840 positions), each with a dense MLP of 18432, which has the per-token FLOPs of V3's MoE
layer (8 routed + 1 shared experts of 2048); vocabulary 4096 (only the last token's logits are
computed). Random weights and token ids (seed 0). ``--tiny``: 4 heads, kv_lora 32, rope 8,
indexer 16 x 32, index_topk 8, hidden 64, float32, N 4 12, P 0 4, pages of 4, backends
reference triton (triton through Triton's interpreter).

One point (backend, P, N): the first P tokens are prefilled in one step (planned with the
library's default dense limit) into the paged caches; the measured step is then the prefill of
the N tokens after them, as a chunked prefill runs it. It runs dense (``dsa_dense_max_kv_len``
= P + N: MHA over the fetched prefix and the new tokens; past index_topk an approximation of
DSA) and sparse (limit 0: indexer, top-k, sparse MLA). A time is the median wall time of the
whole model step (eager, inside the engine's per-step host plan): the time to first token of a
prompt whose first P tokens are cached. Steps are linear in ``--layers``.

Columns: ``kv`` = P + N; ``default`` = the plan the engine's default limit takes (read from
``Engine``, not hard-coded); ``dense ms`` / ``sparse ms``; ``sparse/dense`` (> 1: dense
faster); ``TTFT dense vs sparse`` = (dense / sparse - 1) x 100%, the sign convention of the
MI355X figure (negative: dense faster); ``dense-sparse diff`` = relative L2 difference of the
two paths' outputs (rounding up to index_topk, the approximation's error past it);
``checks`` = the checks that ran.

Checks, before timing; a failure stops the run, saying which check, by how much (the JSON keeps
the rows so far). On the hidden states of all N new tokens after the last layer
(``model.layers_out``), relative L2 error: (1) sparse = dense where dense is exact (kv <= index_topk); (2) dense and
sparse each = the reference backend's on the same caches (the backend's prefix), skipped where
the reference ops would hold a temporary over ``--ref-max-gib`` GiB (their [heads, N, kv]
float32 scores, their gathered [N, index_topk, 576] float32 latents; estimates in the JSON;
with the defaults: N 1024 at both prefixes, and dense N 2048 at P 0). Tolerance (``--tol``):
3e-2 x sqrt(layers) in bf16 (see TOL), 1e-4 in float32.

The MI355X figure (-22% to -43% TTFT for dense at kv length <= 2048) was measured elsewhere; it
is printed as a labelled note beside our table, never as our number.

``--out DIR``: DIR/dsa_prefill.json and DIR/dsa_prefill.md, rewritten after every point.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def _device_arg(argv: list[str]) -> str | None:
    """The --device value on a command line, before argparse (see below)."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return None


if __name__ == "__main__" and _device_arg(sys.argv[1:]) == "cpu":
    # On the CPU the triton backend's kernels run in Triton's interpreter, which Triton enables
    # for kernels defined while TRITON_INTERPRET=1 is set, its own library's included: so before
    # torch and mlagraph import triton (as tests/conftest.py does before the tests import them).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import deepseek_v3_config, device_name, median_time, rel_err, write_json  # noqa: E402

from mlagraph.model import DeepseekForCausalLM  # noqa: E402
from mlagraph.model.batch import build_batch, fits_dense  # noqa: E402
from mlagraph.model.config import DeepseekConfig  # noqa: E402
from mlagraph.ops import backends as backend_registry  # noqa: E402
from mlagraph.ops import host_plan  # noqa: E402

MI355X_NOTE = ("MI355X reference (measured elsewhere, not by this script): dense DSA prefill gave -22% to -43% "
               "TTFT against sparse at kv length <= 2048")
# Relative L2 error allowed between the last layer's hidden states of two paths that compute the same
# thing, per layer of the stack (times sqrt(layers): rounding errors add up like a random walk).
# bf16: the reference ops' dense and sparse paths differ by 7.9e-3 at V3.2's dims (1 layer, N
# 64..256, prefixes 0 and 64; 1.4e-2 over 3 layers), about what a 1% error in the attention output
# gives (7.7e-3); a wrong attention output gives ~1.4.
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
# the defaults of the options, at DeepSeek's dims and with --tiny
REAL = {"lengths": [1024, 2048, 4096, 8192, 16384, 32768], "prefixes": [0, 8192], "backends": ["triton", "flashmla"],
        "page_size": 64, "iters": 5, "warmup": 1}
# few tokens: Triton's interpreter takes milliseconds per kernel program, and runs a program per token
TINY = {"lengths": [4, 12], "prefixes": [0, 4], "backends": ["reference", "triton"], "page_size": 4, "iters": 1,
        "warmup": 0}


class CheckFailed(RuntimeError):
    """A variant's output differed from what it must equal (the message says which and by how much)."""


def v32_config(layers: int, tiny: bool) -> dict:
    """A V3.2 config at DeepSeek's dims (module docstring), or the tiny one."""
    cfg = deepseek_v3_config(layers=layers, heads=128, experts=0)
    cfg.update(model_type="deepseek_v32", hidden_size=7168, intermediate_size=18432, n_routed_experts=0,
               index_topk=2048, index_head_dim=128, index_n_heads=64, max_position_embeddings=163840)
    if tiny:
        cfg.update(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   # 16 indexer heads: a key whose every head's ReLU is 0 (an exact tie at score 0, which two
                   # correct backends may break differently) stays rare
                   index_topk=8, index_head_dim=32, index_n_heads=16, max_position_embeddings=1024)
    return cfg


def reference_bytes(cfg: DeepseekConfig, n: int, kv: int, dense: bool) -> int:
    """About the largest temporary the reference ops make in one step of n new tokens over kv
    keys (layers run one after another, so one layer's)."""
    H, K, W = cfg.num_attention_heads, cfg.index_topk, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if dense:  # mha_prefill: float32 scores, probabilities and their exp [H, n, kv], the mask [n, kv]
        return 3 * 4 * H * n * kv + n * kv
    Di, Hi = cfg.index_head_dim, cfg.index_n_heads
    # indexer_topk: slots [n, kv] int64, rows (bf16) and float32 keys [n, kv, Di], logits [n, Hi, kv];
    # sparse_mla: slots, bf16 rows and float32 latents (twice) [n, K, W], scores / probs [n, H, K]
    return max(n * kv * (8 + 6 * Di + 4 * Hi + 8), n * K * (8 + 2 * W + 8 * W + 12 * H))


def shared_model(base: DeepseekForCausalLM, hf_cfg: dict, backend: str, device: str, dtype) -> DeepseekForCausalLM:
    """``base``'s model on ``backend``, holding base's weight tensors (not copies: a deep stack
    fits once; its own initial weights are freed). ValueError (the library's reason) when the
    backend cannot run here."""
    with torch.device(device):
        model = DeepseekForCausalLM(DeepseekConfig.from_hf(hf_cfg), backend=backend, device=device)
    model.load_state_dict(base.state_dict(), assign=True)
    model = model.to_device_dtype(device, dtype)
    ours = dict(model.named_parameters())
    assert all(ours[k].data_ptr() == p.data_ptr() for k, p in base.named_parameters()), "weights not shared"
    return model


def triton_interpreted() -> bool:
    """Do Triton kernels run in its CPU interpreter in this process (TRITON_INTERPRET=1 set
    before triton was imported)? Then mlagraph's, defined on first use, do too."""
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(standard.cdiv, InterpretedFunction) and os.environ.get("TRITON_INTERPRET") == "1"


def default_dense_limit(model: DeepseekForCausalLM, page_size: int) -> int:
    """The dense limit the engine plans with when it is given none (a one-page engine, read back)."""
    from mlagraph.engine import Engine

    return Engine(model, max_num_seqs=1, max_model_len=page_size, page_size=page_size, num_pages=1,
                  progress=False).dsa_dense_max_kv_len


class Point:
    """One (P, N) on one model: its caches (prefix prefilled), its dense and sparse batches."""

    def __init__(self, model, tokens: list[int], prefix: int, page_size: int, limit: int, device):
        self.model, self.prefix, self.n = model, prefix, len(tokens) - prefix
        caps, total = model.backend.capabilities, len(tokens)
        pages = list(range(-(-total // page_size)))
        self.caches = model.allocate_caches(len(pages), page_size)
        if prefix:
            self.run(build_batch(caps, [tokens[:prefix]], [0], [pages], page_size, dsa=True,
                                 dsa_dense_max_kv_len=limit, device=device))
        self.batches = {
            variant: build_batch(caps, [tokens[prefix:]], [prefix], [pages], page_size, dsa=True,
                                 dsa_dense_max_kv_len=lim, device=device)
            for variant, lim in (("dense", total), ("sparse", 0))
        }
        assert self.batches["dense"].plan.dsa_dense and not self.batches["sparse"].plan.dsa_dense

    def run(self, batch, model=None, hidden: bool = False):
        """One step of ``model`` (default: this point's) as the engine runs it."""
        model = model or self.model
        with torch.no_grad(), host_plan.step(batch.mirrors):
            return model.layers_out(batch, self.caches) if hidden else model(batch, self.caches)


def check(row: dict, name: str, got, want, tol: float) -> None:
    err, diff = rel_err(got, want), float((got.float() - want.float()).abs().max())
    row["checks"][name] = {"rel_err": err, "max_abs_diff": diff, "tol": tol}
    row["checked"].append(name)
    if not err <= tol:
        raise CheckFailed(f"{row['backend']}, prefix {row['prefix']}, N {row['tokens']}: {name}: last-layer hidden states "
                          f"of the {row['tokens']} new tokens differ by relative L2 error {err:.3g} "
                          f"(max abs difference {diff:.3g}); tolerance {tol:g}")


def bench_point(models: dict, name: str, tokens: list[int], prefix: int, args, env: dict) -> dict:
    n, kv = len(tokens) - prefix, len(tokens)
    cfg, model, ref = env["cfg"], models[name], models["reference"]
    row = {"backend": name, "prefix": prefix, "tokens": n, "kv_len": kv,
           "default_plan": "dense" if fits_dense(kv, env["default_limit"]) else "sparse",
           "dense_ms": None, "sparse_ms": None, "sparse_over_dense": None, "ttft_dense_vs_sparse_pct": None,
           "dense_vs_sparse_rel_diff": None, "checks": {}, "checked": [], "note": ""}
    gib = {v: reference_bytes(cfg, n, kv, v == "dense") / 2**30 for v in ("dense", "sparse")}
    row["reference_gib"] = {v: round(g, 2) for v, g in gib.items()}
    if name == "reference":  # the reference backend timed itself: its prefix step too
        prefix_gib = reference_bytes(cfg, prefix, prefix, fits_dense(prefix, env["default_limit"])) / 2**30
        need = max(*gib.values(), prefix_gib)
        if need > args.ref_max_gib:
            row["note"] = f"skipped: the reference ops would need ~{need:.0f} GiB > --ref-max-gib"
            return row
    point = None
    try:
        point = Point(model, tokens, prefix, args.page_size, env["default_limit"], args.device)
        check_point(point, row, ref, tokens, gib, args, env)
        for v, b in point.batches.items():
            row[f"{v}_ms"] = median_time(lambda b=b, p=point: p.run(b), warmup=args.warmup, iters=args.iters) * 1e3
        row["sparse_over_dense"] = row["sparse_ms"] / row["dense_ms"]
        row["ttft_dense_vs_sparse_pct"] = (row["dense_ms"] / row["sparse_ms"] - 1) * 100
    except torch.OutOfMemoryError as e:
        row["note"] = f"out of memory: {str(e).splitlines()[0][:120]}"
    finally:
        point = None  # its caches go before the next point's
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def check_point(point: Point, row: dict, ref, tokens: list[int], gib: dict, args, env: dict) -> None:
    """The point's checks (module docstring), into ``row``; CheckFailed on the first that fails."""
    cfg, tol, prefix, kv = env["cfg"], env["tol"], point.prefix, len(tokens)
    out = {v: point.run(b, hidden=True) for v, b in point.batches.items()}
    if kv <= cfg.index_topk:
        check(row, "sparse=dense", out["sparse"], out["dense"], tol)
    else:  # not a check: how far dense attention (an approximation of DSA here) is from it
        row["checks"]["sparse=dense"] = "n/a: kv > index_topk (dense is an approximation there)"
    row["dense_vs_sparse_rel_diff"] = rel_err(out["dense"], out["sparse"])
    for v in ("dense", "sparse"):
        key = f"{v}=reference"
        if point.model is ref:
            row["checks"][key] = "n/a: is the reference"
        elif gib[v] > args.ref_max_gib:
            row["checks"][key] = f"skipped: the reference would need ~{gib[v]:.0f} GiB > --ref-max-gib"
        else:  # on the same caches (the backend's prefix); the reference rewrites only the new tokens' rows
            b = build_batch(ref.backend.capabilities, [tokens[prefix:]], [prefix],
                            [list(range(-(-kv // args.page_size)))], args.page_size, dsa=True,
                            dsa_dense_max_kv_len=kv if v == "dense" else 0, device=args.device)
            check(row, key, out[v], point.run(b, ref, hidden=True), tol)


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    lines = [("| backend | prefix | N | kv | default | dense ms | sparse ms | sparse/dense | TTFT dense vs sparse | "
              "dense-sparse diff | checks |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pct = "-" if r["ttft_dense_vs_sparse_pct"] is None else f"{r['ttft_dense_vs_sparse_pct']:+.1f}%"
        checks = ", ".join(r["checked"]) or "-"
        if r["note"]:
            checks = f"{checks}; {r['note']}"
        lines.append(f"| {r['backend']} | {r['prefix']} | {r['tokens']} | {r['kv_len']} | {r['default_plan']} | "
                     f"{fmt(r['dense_ms'], '.2f')} | {fmt(r['sparse_ms'], '.2f')} | "
                     f"{fmt(r['sparse_over_dense'], '.2f')} | {pct} | {fmt(r['dense_vs_sparse_rel_diff'], '.1e')} | "
                     f"{checks} |")
    return lines


def crossovers(rows: list[dict]) -> list[str]:
    """Per backend and prefix: the smallest N (of those run) from which sparse is faster."""
    out = []
    for key in dict.fromkeys((r["backend"], r["prefix"]) for r in rows):
        timed = sorted((r for r in rows if (r["backend"], r["prefix"]) == key and r["sparse_ms"]),
                       key=lambda r: r["tokens"])
        if not timed:
            continue
        faster = [r["tokens"] for r in timed if r["sparse_ms"] < r["dense_ms"]]
        where = (f"sparse faster at N = {', '.join(map(str, faster))}" if faster else
                 f"dense faster at every N run ({timed[0]['tokens']}..{timed[-1]['tokens']})")
        out.append(f"- {key[0]}, prefix {key[1]}: {where}")
    return out


def markdown(payload: dict) -> str:
    head = (f"DSA prefill, {payload['layers']} V3.2 layer(s), {payload['dims']}, {payload['dtype']}, "
            f"{payload['device']}, torch {payload['torch']}, {payload['date']}")
    lines = [head, ""]
    lines += [f"Skipped backend {b}: {why}" for b, why in payload["skipped_backends"].items()]
    lines += crossovers(payload["rows"])
    lines += [(f"Default dense limit (the library's): kv <= {payload['default_dense_limit']} (index_topk "
               f"{payload['index_topk']}). TTFT dense vs sparse = dense / sparse - 1 (negative: dense faster)."),
              f"Note: {MI355X_NOTE}.", "", *table(payload["rows"])]
    return "\n".join(lines) + "\n"


def save(payload: dict, out: str | None) -> None:
    if not out:
        return
    write_json(out, "dsa_prefill.json", payload)
    with open(os.path.join(out, "dsa_prefill.md"), "w") as f:
        f.write(markdown(payload))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=None,
                   help=f"default: {' '.join(REAL['backends'])} ({' '.join(TINY['backends'])} with --tiny)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="new tokens N per point")
    p.add_argument("--prefixes", type=int, nargs="+", default=None, help="cached prefix lengths P")
    p.add_argument("--layers", type=int, default=1, help="V3.2 layers in the stack (time = the whole step)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per variant, median (default 5; 1 with --tiny)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before them (default 1; 0 with --tiny: the checked steps warmed up)")
    p.add_argument("--page-size", type=int, default=None, help="default 64 (16 with --tiny)")
    p.add_argument("--ref-max-gib", type=float, default=24.0,
                   help="compare with the reference backend only where its ops need at most this (GiB)")
    p.add_argument("--tol", type=float, default=None,
                   help="allowed relative L2 error of a check (default: 3e-2 * sqrt(layers) in bf16, 1e-4 in float32)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--out", default=None, help="directory for dsa_prefill.json and dsa_prefill.md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims for a CPU smoke run")
    args = p.parse_args(argv)
    preset = TINY if args.tiny else REAL
    for key in ("lengths", "prefixes", "backends", "page_size", "iters", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    known = backend_registry.names() + ["auto"]
    bad = [b for b in args.backends if b not in known]
    if bad:
        p.error(f"--backends: unknown {', '.join(map(repr, bad))}; known backends: {', '.join(known)}")
    if len(set(args.backends)) != len(args.backends):
        p.error(f"--backends: each at most once, got {' '.join(args.backends)}")
    if any(n < 1 for n in args.lengths):
        p.error(f"--lengths: expected new-token counts >= 1, got {args.lengths}")
    if any(x < 0 for x in args.prefixes):
        p.error(f"--prefixes: expected cached prefix lengths >= 0, got {args.prefixes}")
    for key in ("layers", "iters", "page_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: expected an int >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        p.error(f"--warmup: expected an int >= 0, got {args.warmup}")
    if args.tol is not None and not args.tol >= 0:
        p.error(f"--tol: expected a number >= 0, got {args.tol}")
    if not args.ref_max_gib >= 0:
        p.error(f"--ref-max-gib: expected a number >= 0, got {args.ref_max_gib}")
    dev = torch.device(args.device) if args.device in ("cpu", "cuda") or args.device.startswith("cuda:") else None
    if dev is None:
        p.error(f"--device: expected cpu, cuda or cuda:<i>, got {args.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (use --device cpu --tiny for a smoke run)")
    longest = max(args.lengths) + max(args.prefixes)
    limit = v32_config(1, args.tiny)["max_position_embeddings"]
    if longest > limit:
        p.error(f"--lengths/--prefixes: the longest prompt ({longest} tokens) exceeds the model's {limit} positions")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    no_interpreter = args.device == "cpu" and not triton_interpreted()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.tiny else torch.bfloat16
    hf_cfg = v32_config(args.layers, args.tiny)
    base = DeepseekForCausalLM.from_config(hf_cfg, backend="reference", dtype=dtype, device=args.device)
    cfg = base.config
    models, skipped = {"reference": base}, {}
    for name in args.backends:
        if name == "reference":
            continue
        if no_interpreter:
            skipped[name] = ("its Triton kernels need Triton's interpreter on the CPU: TRITON_INTERPRET=1 must be set "
                             "before triton is imported (run this script from the command line, or set it yourself)")
            continue
        try:
            models[name] = shared_model(base, hf_cfg, name, args.device, dtype)
        except ValueError as e:  # the library's own reason (not installed, wrong GPU, head counts, ...)
            skipped[name] = str(e)
            continue
        sizes = models[name].backend.capabilities.page_sizes
        if sizes is not None and args.page_size not in sizes:
            skipped[name] = f"takes pages of {sorted(sizes)} tokens, not --page-size {args.page_size}"
            del models[name]
    tol = args.tol if args.tol is not None else TOL[dtype] * math.sqrt(args.layers)
    env = {"cfg": cfg, "tol": tol, "default_limit": default_dense_limit(base, args.page_size)}
    dims = (f"{cfg.num_attention_heads} heads, kv_lora {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, "
            f"indexer {cfg.index_n_heads}x{cfg.index_head_dim}, index_topk {cfg.index_topk}, hidden {cfg.hidden_size}, "
            f"MLP {cfg.intermediate_size}")
    payload = {"device": device_name(args.device), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "dtype": str(dtype).removeprefix("torch."), "layers": args.layers, "dims": dims,
               "page_size": args.page_size, "index_topk": cfg.index_topk, "default_dense_limit": env["default_limit"],
               "iters": args.iters, "warmup": args.warmup, "ref_max_gib": args.ref_max_gib, "tolerance": tol,
               "backends": args.backends, "skipped_backends": skipped, "mi355x_note": MI355X_NOTE, "rows": []}
    for name, why in skipped.items():
        print(f"skipped backend {name}: {why}", flush=True)
    print(f"DSA prefill, {args.layers} layer(s), {dims}, {payload['dtype']}, {payload['device']}; "
          f"default dense limit {env['default_limit']}", flush=True)
    run = [b for b in args.backends if b in models]
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for prefix in args.prefixes:
        for n in args.lengths:
            tokens = torch.randint(1, cfg.vocab_size, (prefix + n,), generator=g).tolist()
            for name in run:
                try:
                    row = bench_point(models, name, tokens, prefix, args, env)
                except CheckFailed as e:
                    payload["failed_check"] = str(e)
                    save(payload, args.out)
                    raise
                payload["rows"].append(row)
                save(payload, args.out)
                pct = row["ttft_dense_vs_sparse_pct"]
                print(f"  {name} P={prefix} N={n}: dense {fmt(row['dense_ms'], '.2f')} ms, sparse "
                      f"{fmt(row['sparse_ms'], '.2f')} ms, TTFT dense vs sparse {fmt(pct, '+.1f')}% "
                      f"[checked: {', '.join(row['checked']) or '-'}] {row['note']} ({time.time() - t0:.0f} s)",
                      flush=True)
    print()
    print(markdown(payload), end="")
    return payload


if __name__ == "__main__":
    try:
        main()
    except CheckFailed as e:
        sys.exit(f"dsa_prefill: check failed, run stopped: {e}")
