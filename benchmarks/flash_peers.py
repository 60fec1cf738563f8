"""``benchmarks/kernels.py --only flash``: each flash backend's op beside the raw library kernel.

For every workload of issue 13's table, in one process on the same inputs: our triton op, the
``flashmla`` / ``flashinfer`` backend op (the op twin: checks, metadata made once per step and
the contract fixes included) and the raw library call with its metadata made beforehand (what a
hand-written integration would run per layer). Every variant is checked against the reference
op before it is timed; the note of a backend row gives its time over the raw kernel's (goal:
within 3%). A library that is missing (or an API that moved) is a row with the reason.

Decode rows are timed as the engine runs decode: inside a CUDA graph (replays of 4 calls, the
step's plans made before capture), so what a row shows is GPU time, the wrapper's kernels
included and the host's Python excluded. Beside them, ``<lib> backend eager`` times the op
called from Python (what a user without graphs pays per layer) and ``<lib> step plan`` the
once-per-step re-plan the engine runs before a replay (shared by every layer). Prefill rows run
eagerly, as the engine's prefill does.

Queries are given as the model gives them: q_nope and q_pe are the two halves of the fused
RoPE + cache-write op's one q (adjacent views), so a backend that reads q joined (FlashMLA)
takes it in place, as in the decode graph; the raw calls get the joined tensor.
"""

from __future__ import annotations

import torch

from mlagraph.ops import backends, host_plan, layouts

L, R, V, NOPE = 512, 64, 128, 128
SCALE = 0.1352
REF = torch.ops.mlagraph


def _in_step(fn, step):
    """fn run as an engine step runs it: inside one host_plan step (plans made on the first call)."""

    def call():
        with host_plan.step(step):
            return fn()
    return call


def _raw_flashmla_decode(q_nope, q_pe, cache, table, lens, layout):
    import flash_mla

    q = torch.cat([q_nope, q_pe], -1)
    sched = flash_mla.get_mla_metadata()[0]
    if layout == "fp8_ds":
        raise NotImplementedError("raw FlashMLA dense decode reads bf16 only")
    k = cache.unsqueeze(2)
    fn = lambda: flash_mla.flash_mla_with_kvcache(q, k, table, lens, L, sched, softmax_scale=SCALE,  # noqa: E731
                                                  causal=q.shape[1] > 1, use_legacy=True)
    fn()  # fills sched once, as a caller hoisting it would (and before a capture)
    return fn, [fn]


def _raw_flashinfer_decode(q_nope, q_pe, cache, table, lens):
    import flashinfer
    from mlagraph.ops.flashinfer.kernels import mla_csr

    b, s_q, h, _ = q_nope.shape
    i32 = dict(dtype=torch.int32, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(  # graph-safe buffers: the raw call is timed in a graph too
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        qo_indptr=torch.empty(b + 1, **i32), kv_indptr=torch.empty(b + 1, **i32),
        kv_indices=torch.empty(table.numel(), **i32), kv_len_arr=torch.empty(b, **i32), backend="fa3")
    meta = flashinfer.mla.MLAPlanMetadata.csr(*mla_csr(table.cpu(), lens.cpu(), cache.shape[1], s_q))
    w.plan(metadata=meta, num_heads=h, head_dim_ckv=L, head_dim_kpe=R, page_size=cache.shape[1], causal=s_q > 1,
           sm_scale=SCALE, q_data_type=q_nope.dtype, kv_data_type=cache.dtype, query_layout="split",
           kv_cache_layout="split", lse_mode="basee")
    qn, qp = q_nope.reshape(b * s_q, h, L), q_pe.reshape(b * s_q, h, R)
    kv = (cache[..., :L], cache[..., L:])
    fn = lambda: tuple(t.view(b, s_q, h, -1) if t.dim() == 3 else t.view(b, s_q, h)  # noqa: E731
                       for t in w.run(query=(qn, qp), kv_cache=kv, return_lse=True, return_lse_base_on_e=True))
    return fn, [fn]


def _ratio_notes(rows, workload):
    times = {r.variant: r.time_us for r in rows if r.workload == workload and r.time_us}
    for r in rows:
        if r.workload != workload or not r.time_us:
            continue
        for lib in ("flashmla", "flashinfer"):
            raw = times.get(f"{lib} raw")
            if r.variant == f"{lib} backend" and raw:
                r.note = (r.note + f" {r.time_us / raw - 1:+.1%} vs raw").strip()


KEYS_SWEEP_BASE = {"FORM": "keys", "TMA": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _decode_case(h: int, b: int, ctx: int, s_q: int, g):
    """mla_decode's arguments for b requests of ctx keys (bf16 cache, pages of 64) and a check of
    an output against the float32 reference (its gather fits: at most ~2 GB here)."""
    from kernels import paged_cache, rel_err  # benchmarks/kernels.py (the caller)

    cache, _, table, lens = paged_cache("bf16", [ctx] * b, 64, g)
    # q_nope and q_pe as the decode graph passes them: the two halves of the fused op's one q
    q = torch.randn(b, s_q, h, L + R, device="cuda", dtype=torch.bfloat16)
    args_ = (q[..., :L], q[..., L:], cache, table, lens, None, "bf16", SCALE)
    want = REF.mla_decode(*args_)[0]
    return args_, lambda out: rel_err(out[0], want)


def _available(name):
    try:
        return backends.get(name, "cuda"), ""
    except ValueError as e:
        return None, str(e)


def bench_flash(rows, args, g):
    from kernels import KEYS_SWEEP, Runner, paged_cache, rel_err, sweep  # benchmarks/kernels.py (the caller)
    from mlagraph.ops.triton import decode as triton_decode
    from mlagraph.ops.triton import sparse as triton_sparse

    fm, fm_why = _available("flashmla")
    fi, fi_why = _available("flashinfer")
    cases = [(128, 128, 4096, 1), (128, 128, 4096, 2), (128, 128, 1151, 1), (16, 128, 4096, 1), (16, 128, 4096, 2),
             (16, 64, 16384, 1)]
    parts = set(args.flash_parts.split(","))
    for h, b, ctx, s_q in cases if "decode" in parts else []:
        name = f"flash mla_decode H={h} B={b} L={ctx} s_q={s_q} bf16"
        print(name, flush=True)
        args_, check = _decode_case(h, b, ctx, s_q, g)
        q_nope, q_pe, cache, table, lens = args_[:5]
        run = Runner(rows, name, 2 * h * s_q * 1088 * b * ctx, 1152 * b * ctx, tol=2e-2)
        triton_op = lambda: torch.ops.mlagraph_triton.mla_decode(*args_)  # noqa: E731
        run.run("triton", triton_op, check, graph_fns=[triton_op])
        if args.sweep and h * s_q <= 32:
            sweep(run, lambda config: triton_decode.mla_decode_with_config(*args_, config=config), check,
                  KEYS_SWEEP.get((s_q, b), KEYS_SWEEP.get(s_q, [])), graphs=True)
        if args.new_forms and h * s_q <= 32:  # the keys form's Gluon twin with its loader warp
            sweep(run, lambda config: triton_decode.mla_decode_with_config(*args_, config=config), check,
                  [{"FORM": "keys", "TMA": True, "WS": True},
                   {"FORM": "keys", "TMA": True, "WS": True, "MAX_SPLITS": 2}], graphs=True)
        if h * s_q > 16:
            # The Gluon form (the default on Hopper past 16 rows) against the forms it replaced.
            sweep(run, lambda config: triton_decode.mla_decode_with_config(*args_, config=config), check,
                  [{"FORM": "rows"}, {"FORM": "wgmma", "MAX_SPLITS": 2}, {"FORM": "wgmma", "num_stages": 1},
                   {"FORM": "wgmma", "OVERLAP": True}]
                  + ([{**KEYS_SWEEP_BASE, "BLOCK_H": 32}] if h * s_q <= 32 else [])
                  + ([{"FORM": "wgmma", "SEESAW": True}, {"FORM": "wgmma", "SEESAW": True, "MAX_SPLITS": 2}]
                     if args.new_forms else []), graphs=True)
        mirrors = {table: table.cpu(), lens: lens.cpu()}
        for lib, backend, why, raw in (("flashmla", fm, fm_why, lambda: _raw_flashmla_decode(q_nope, q_pe, cache, table, lens, "bf16")),
                                       ("flashinfer", fi, fi_why, lambda: _raw_flashinfer_decode(q_nope, q_pe, cache, table, lens))):
            if backend is None:
                run.skip(f"{lib} backend", why)
                continue
            op, step = backend.op("mla_decode"), host_plan.Step(mirrors)
            ours = _in_step(lambda op=op: op(*args_), step)
            run.run(f"{lib} backend", ours, check, graph_fns=[ours])
            run.peer(f"{lib} raw", raw, check)
            run.run(f"{lib} backend eager", ours, check, note="Python per call, no graph")
            # a re-plan has no output of its own: the backend rows above checked the op with this plan
            run.run(f"{lib} step plan", lambda step=step: step.refresh(mirrors), lambda _: 0.0,
                    note=f"once per step for all layers ({step.num_plans} plan)")
        _ratio_notes(rows, name)
    # Issue 18: any head count a tensor-parallel shard has, at the same efficiency per head. One
    # shape (B=128, L=4096, s_q=1, the memory-bound decode) across head counts: our op as the
    # engine runs it and each library's raw kernel where it takes that count (a row with the
    # library's refusal where not). Bytes per row: the keys read once per request.
    for h in (1, 8, 16, 24, 32, 64, 128) if "heads" in parts else []:
        b, ctx = 128, 4096
        name = f"heads mla_decode H={h} B={b} L={ctx} s_q=1 bf16"
        print(name, flush=True)
        args_, check = _decode_case(h, b, ctx, 1, g)
        q_nope, q_pe, cache, table, lens = args_[:5]
        run = Runner(rows, name, 2 * h * 1088 * b * ctx, 1152 * b * ctx, tol=2e-2)
        triton_op = lambda args_=args_: torch.ops.mlagraph_triton.mla_decode(*args_)  # noqa: E731
        run.run("triton", triton_op, check, graph_fns=[triton_op])
        if h >= 24:
            # The keys-major form in row blocks of 16 or 32 (each block re-reads the keys, mostly
            # from L2), the rows form, and the Gluon form at 2 splits against the default (the
            # Gluon form past 16 rows, which pads the 64-row block at 24-32; the wave rule's
            # splits, one here).
            sweep(run, lambda config: triton_decode.mla_decode_with_config(*args_, config=config), check,
                  [{**KEYS_SWEEP_BASE, "BLOCK_H": bh, "MAX_SPLITS": sp} for bh in (16, 32) for sp in (1, 2)]
                  + [{"FORM": "rows"}, {"FORM": "wgmma", "MAX_SPLITS": 2}]
                  + ([{"FORM": "wgmma", "SEESAW": True}] if args.new_forms else [])
                  + ([{"FORM": "keys", "TMA": True, "WS": True}] if args.new_forms and h <= 32 else []), graphs=True)
        elif args.new_forms:  # 1-16 heads: the keys form's Gluon twin
            sweep(run, lambda config: triton_decode.mla_decode_with_config(*args_, config=config), check,
                  [{"FORM": "keys", "TMA": True, "WS": True}], graphs=True)
        run.peer("flashmla raw", lambda: _raw_flashmla_decode(q_nope, q_pe, cache, table, lens, "bf16"), check)
        run.peer("flashinfer raw", lambda: _raw_flashinfer_decode(q_nope, q_pe, cache, table, lens), check)
        del cache, table, lens, q_nope, q_pe, args_, check

    # sparse: FlashMLA only (FlashInfer's sparse MLA is not a backend op here)
    for layout, tokens, ctx, topk, what in (("bf16", 4096, 32768, 2048, "prefill"),
                                            ("fp8_ds", 256, 32768, 2048, "decode B128 s_q 2")) if "sparse" in parts else ():
        name = f"flash sparse_mla {what} T={tokens} ctx={ctx} top-{topk} H=128 {layout}"
        print(name, flush=True)
        if fm is None:
            Runner(rows, name, 0, 0, tol=2e-2).skip("flashmla backend", fm_why)
            continue
        cache, _, table, lens = paged_cache(layout, [ctx], 64, g)
        idx = torch.stack([torch.randperm(ctx, device="cuda")[:topk] for _ in range(tokens)]).int()
        q = torch.randn(tokens, 128, L + R, device="cuda", dtype=torch.bfloat16)
        q_nope, q_pe = q[..., :L], q[..., L:]  # as the model passes them (halves of one q)
        req = torch.zeros(tokens, dtype=torch.int32, device="cuda")
        args_ = (q_nope, q_pe, cache, idx, req, table, None, layout, SCALE)
        want = torch.ops.mlagraph_triton.sparse_mla(*args_)[0]
        check = lambda out: rel_err(out[0], want)  # noqa: E731
        run = Runner(rows, name, 2 * 128 * 1088 * tokens * topk, layouts.latent_row_width(layout, L, R) * tokens * topk,
                     tol=2e-2)
        graphed = layout == "fp8_ds"  # the decode form runs in the decode graph; prefill eagerly
        triton_op = lambda: torch.ops.mlagraph_triton.sparse_mla(*args_)  # noqa: E731
        ours = _in_step(lambda: fm.op("sparse_mla")(*args_), host_plan.Step())
        run.run("triton", triton_op, check, graph_fns=[triton_op] if graphed else None)
        if layout == "bf16":  # the Gluon form (sparse_wgmma, the default here) against the Triton kernel
            sweep(run, lambda config: triton_sparse.sparse_mla(*args_, config=config), check,
                  [{"FORM": "rows"}, {"FORM": "wgmma", "num_stages": 1}]
                  + ([{"FORM": "wgmma", "SEESAW": True}] if args.new_forms else []), graphs=graphed)
        elif args.new_forms:  # fp8_ds: the Gluon kernel that widens the rows into a bf16 tile
            sweep(run, lambda config: triton_sparse.sparse_mla(*args_, config=config), check, [{"FORM": "wgmma"}],
                  graphs=graphed)
        run.run("flashmla backend", ours, check, graph_fns=[ours] if graphed else None)

        def raw_sparse():
            import flash_mla
            from mlagraph.ops._paged import flat_slots

            slots = flat_slots(table, idx, req, 64)
            q = torch.cat([q_nope, q_pe], -1)
            if layout == "bf16":
                kv = cache.view(-1, 1, cache.shape[-1])
                return lambda: flash_mla.flash_mla_sparse_fwd(q, kv, slots[:, None], SCALE, d_v=L, use_legacy=True)
            sched = flash_mla.get_mla_metadata()[0]
            k = cache.view(torch.float8_e4m3fn).view(cache.shape[0], 64, 1, -1)
            fn = lambda: flash_mla.flash_mla_with_kvcache(q[:, None], k, None, None, L, sched,  # noqa: E731
                                                          softmax_scale=SCALE, is_fp8_kvcache=True,
                                                          indices=slots[:, None], use_legacy=True)
            fn()  # fills sched before a capture
            return fn, [fn]

        run.peer("flashmla raw", raw_sparse, lambda out: rel_err(out[0].reshape(want.shape), want))
        _ratio_notes(rows, name)

    # dense causal prefill: FlashInfer's ragged fa3
    for n in (2048, 8192) if "prefill" in parts else ():
        name = f"flash mha_prefill N={n} H=128 qk 192 v 128 causal"
        print(name, flush=True)
        if fi is None:
            Runner(rows, name, 0, 0, tol=2e-2).skip("flashinfer backend", fi_why)
            continue
        q = torch.randn(n, 128, NOPE + R, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(n, 128, NOPE + R + V, device="cuda", dtype=torch.bfloat16)
        k, v = kv[..., :NOPE + R], kv[..., NOPE + R:]
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        args_ = (q, k, v, cu, cu, SCALE, True)
        want = torch.ops.mlagraph_triton.mha_prefill(*args_)[0]
        check = lambda out: rel_err(out[0], want)  # noqa: E731
        run = Runner(rows, name, 40960 * n * n, 0, tol=2e-2)
        run.run("triton", lambda: torch.ops.mlagraph_triton.mha_prefill(*args_), check)
        ours = _in_step(lambda: fi.op("mha_prefill")(*args_), host_plan.Step({cu: cu.cpu()}))
        run.run("flashinfer backend", ours, check)

        def raw_prefill():
            import flashinfer

            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                                "NHD", backend="fa3")
            w.plan(cu.cpu(), cu.cpu(), 128, 128, NOPE + R, head_dim_vo=V, causal=True, sm_scale=SCALE,
                   q_data_type=torch.bfloat16)
            return lambda: w.run(q, k, v, return_lse=True, lse_base="ln")

        run.peer("flashinfer raw", raw_prefill, check)
        _ratio_notes(rows, name)
