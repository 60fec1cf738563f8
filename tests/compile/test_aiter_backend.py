"""The REAL aiter backend under torch.compile: its fusion, its lints, and the seed failures of
docs/design.md rule 1 reproduced and prevented.

(a) a triton-backend and an aiter-backend model compiled in one process, both orders, with
    Inductor's FX graph cache on: each runs only its own fused op and both match the
    reference backend;
(b) a graph where aiter's fused op (which returns no K) feeds a consumer of K is rejected at
    compile time, naming the layer, instead of faulting on the GPU;
(c) decode dispatch on the triton backend never reaches an aiter op, whatever the environment
    says.

aiter's kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), as
do the triton backend's. The fake aiter-like backend (fake_backend.py) tests the same machinery
without aiter; these tests run the real ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import mlagraph
import mlagraph.ops.triton.decode as triton_decode
import mlagraph.ops.triton.rope_cache as triton_rope_cache
from mlagraph import passes
from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import BatchKind, BatchPlan, ForwardMethod, build_batch, choose_forward_method
from mlagraph.ops import aiter as aiter_backend
from mlagraph.ops import backends
from mlagraph.ops.aiter import kernels as aiter_kernels
from mlagraph.passes import LintError, lints
from mlagraph.passes.graph_utils import is_auto_functionalized, op_name
from tests.model.conftest import hf_config

from .test_passes import (
    FUSED, H, KINDS, PAGE, REF, L, R, T, Toy, _fused, _rope, _write, capture, clone_caches, compile_toy,
    compiled_vs_eager, decode_ok, prefill_ok, raises_from_compile, records, scenario, tiny_config, toy_inputs,
)

AITER_OK, AITER_WHY = aiter_backend.available()
pytestmark = [
    pytest.mark.skipif(not AITER_OK, reason=AITER_WHY),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU runs of Triton kernels need TRITON_INTERPRET=1 (set by tests/conftest.py)"),
    pytest.mark.filterwarnings("ignore:invalid value encountered"),  # aiter decode's 0/0 on padding rows
]

AITER_FUSED = "mlagraph_aiter::fused_rope_concat_cache_write"
AITER_DECODE = "mlagraph_aiter::mla_decode"
TRITON_FUSED = "mlagraph_triton::fused_rope_concat_cache_write"
aiter_ops = torch.ops.mlagraph_aiter
mg = torch.ops.mlagraph


def text(qualified: str) -> str:
    """How the canonical printer shows an op: 'mlagraph_aiter.mla_decode('."""
    return qualified.replace("::", ".") + "("


@pytest.fixture(autouse=True)
def _clean_state():
    torch._dynamo.reset()
    before = backends.names()
    yield
    assert backends.names() == before


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts real executions of each backend's fused-op and decode kernels (looked up by the
    op twins at call time, so compiled graphs are counted too)."""
    calls = Counter()

    def count(module, name, key):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    count(aiter_kernels, "fused_rope_concat_cache_write", "aiter_fused")
    count(aiter_kernels, "mla_decode", "aiter_decode")
    count(triton_rope_cache, "fused_rope_concat_cache_write", "triton_fused")
    count(triton_decode, "mla_decode", "triton_decode")
    return calls


class OpsSeen(TorchDispatchMode):
    """Records the qualified name of every op dispatched (custom ops included) in eager mode."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def same_weights(kind_or_cfg, *names: str, layers: int | None = None) -> list[DeepseekForCausalLM]:
    """One model per backend name, all with the first one's random weights."""
    cfg = hf_config(kind_or_cfg) if isinstance(kind_or_cfg, str) else kind_or_cfg
    if layers is not None:
        cfg = cfg.to_dict() | {"num_hidden_layers": layers}
    models = [DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend=n) for n in names]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


# ---------------------------------------------------------------------------------------------
# the aiter model's graphs, kind by kind


AITER_METHOD = {  # aiter has no multi-token decode: verify steps run MHA over the cached prefix
    "prefill": ForwardMethod.MHA,
    "chunked_prefill": ForwardMethod.MHA_PREFIX,
    "decode": ForwardMethod.ABSORBED,
    "multi_token_decode": ForwardMethod.MHA_PREFIX,
}


@pytest.mark.parametrize("kind", KINDS)
def test_aiter_model_graphs(kind, kernel_calls):
    """V3, 2 layers, strict (every lint runs): where the K is needed only by the cache write
    (decode; MHA over a prefix read back from the cache), each layer's rope + cat + write becomes
    aiter's fused op, whose K output nothing reads, and no concat is eliminated (aiter's decode
    reads q concatenated, straight from the fused op's q). Plain MHA prefill builds its keys
    from the rotated K, which aiter's op does not return: left unfused, not rotated twice. The
    compiled step equals eager and runs aiter's kernel once per fused layer."""
    m = DeepseekForCausalLM.from_config(hf_config("v3"), init_std=0.2, backend="aiter")
    r = compiled_vs_eager(m, kind)
    assert r.batch.method is AITER_METHOD[kind]
    torch.testing.assert_close(r.compiled, r.eager, atol=1e-5, rtol=0)
    for e, c in zip(r.eager_caches, r.compiled_caches):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=0)
    after, g = r.report.after, r.report.graph
    assert r.report.backend == "aiter" and sorted(r.lints_ran) == sorted(lints.LINTS)
    assert text(TRITON_FUSED) not in after and text(FUSED) not in after
    if kind == "prefill":
        assert r.report.records == []
        # the unfused layers run the backend's RoPE and cache write (triton's, aiter's fallbacks)
        assert after.count("mlagraph_triton.rope(") == 2 and after.count("mlagraph_triton.latent_cache_write(") == 2
        assert "mlagraph.rope(" not in after and "mlagraph.latent_cache_write(" not in after
        assert after.count("mlagraph_triton.mha_prefill(") == 2
        return
    assert r.report.records == records(g, "fuse_rope_concat_cache", [0, 1])
    assert after.count(text(AITER_FUSED)) == 2 and "mlagraph.rope(" not in after
    fused_values = [line.split(" = ")[0] for line in after.splitlines() if text(AITER_FUSED) in line]
    for v in fused_values:
        assert f"{v}.1" not in after  # the empty K is never read
    if kind == "decode":
        assert after.count(text(AITER_DECODE)) == 2
        for v in fused_values:  # the decode reads both halves of the fused op's q in place
            assert f"{text(AITER_DECODE)}q_nope={v}.0~, q_pe={v}.0~" in after
    assert kernel_calls["aiter_fused"] == 2 and kernel_calls["triton_fused"] == 0


def test_aiter_v32_decode_graph():
    """V3.2 on aiter: sparse MLA is triton's (a declared fallback) and reads the q that aiter's
    fused op returns; the indexer's own NeoX RoPE is untouched."""
    m = DeepseekForCausalLM.from_config(hf_config("v32"), init_std=0.2, backend="aiter")
    r = compiled_vs_eager(m, "decode")
    assert r.batch.method is ForwardMethod.SPARSE
    torch.testing.assert_close(r.compiled, r.eager, atol=1e-5, rtol=0)
    after = r.report.after
    assert after.count(text(AITER_FUSED)) == 2 and after.count("mlagraph_triton.sparse_mla(") == 2
    assert after.count("mlagraph_triton.rope(") == 2  # the indexer's (aiter declares triton's rope)


# ---------------------------------------------------------------------------------------------
# lints on aiter graphs: RoPE exactly once


def _aiter_decode(x, q_nope, q_pe, cache):
    o, _ = aiter_ops.mla_decode(q_nope.reshape(T, 1, H, L), q_pe.reshape(T, 1, H, R), cache, x["block_table"],
                                x["seq_lens"], None, "bf16", 0.5)
    return o


def aiter_decode_ok(x, cache):
    """The model's decode front for aiter: RoPE -> cat -> write, aiter's decode reading q."""
    q_rot, k_rot = _rope(x)
    q = torch.cat([x["q_lat"], q_rot], dim=-1)
    _write(x, k_rot[:, 0], cache)
    return _aiter_decode(x, q[..., :L], q[..., L:], cache)


def aiter_decode_unrotated_q(x, cache):
    """BROKEN: aiter's decode reads the raw q_pe (RoPE skipped for q)."""
    _, k_rot = _rope(x)
    _write(x, k_rot[:, 0], cache)
    return _aiter_decode(x, x["q_lat"], x["q_pe"], cache)


def aiter_rope_then_fused(x, cache):
    """BROKEN (lesson 2): RoPE applied, then aiter's fused op, which applies RoPE itself."""
    q_rot, k_rot = _rope(x)
    q, _ = _fused(x, x["q_lat"], q_rot, k_rot, op=aiter_ops.fused_rope_concat_cache_write, cache=cache)
    return _aiter_decode(x, q[..., :L], q[..., L:], cache)


def aiter_fused_and_rope_for_k(x, cache):
    """BROKEN: aiter's fused op rotates and writes; a second RoPE rotates K for MHA."""
    q, _ = _fused(x, x["q_nope"], op=aiter_ops.fused_rope_concat_cache_write, cache=cache)
    _, k_rot = _rope(x)
    k = torch.cat([x["k_nope"], k_rot.expand(T, H, R)], dim=-1)
    out, _ = mg.mha_prefill(q, k, x["v"], x["cu"], x["cu"], 0.5, True)
    return out


def aiter_fused_k_read(x, cache):
    """BROKEN on aiter: reads the K that aiter's fused op does not return."""
    q, k = _fused(x, x["q_lat"], op=aiter_ops.fused_rope_concat_cache_write, cache=cache)
    return _aiter_decode(x, q[..., :L], q[..., L:], cache) + k.sum()


@pytest.mark.parametrize(
    "body, op, what",
    [
        (aiter_rope_then_fused, AITER_FUSED, "RoPE applied twice"),
        (aiter_fused_and_rope_for_k, "mlagraph::rope", "rotated 2 times"),
        (aiter_decode_unrotated_q, AITER_DECODE, "RoPE skipped.*q_pe is not rotated"),
    ],
    ids=["fused_on_rotated", "k_rotated_again_for_mha", "decode_q_unrotated"],
)
def test_lint_rope_once_on_aiter_graphs(body, op, what):
    """lint_rope_once reads aiter's table (its fused op rotates) and its ops (its decode is a
    latent attention op): RoPE twice or skipped is rejected naming the layer and the op, on
    the captured graph and at compile time; the correct aiter front passes and fuses."""
    aiter = backends.get("aiter")
    graph = capture(Toy(aiter_decode_ok, body), *toy_inputs())
    with pytest.raises(LintError, match=what) as info:
        lints.lint_rope_once(graph, aiter)
    assert "layer 1" in str(info.value) and op in str(info.value) and "layer 0" not in str(info.value)
    with raises_from_compile(LintError, "layer 1", what):
        compile_toy(aiter_decode_ok, body, attention_backend="aiter")
    out, eager = compile_toy(aiter_decode_ok, aiter_decode_ok, attention_backend="aiter", strict=True)
    assert passes.last_compile().after.count(text(AITER_FUSED)) == 2
    for o, e in zip(out, eager):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# (b) aiter's fused op feeding a consumer of K: rejected at compile time


def test_missing_k_consumer_is_rejected_at_compile_time():
    """The seed bug (null-K GPU fault), prevented with the real op: a graph fused for a backend
    whose fused op returns K (the reference), run with aiter's op, still feeds K to MHA
    prefill: lint_backend_ops rejects it naming layer 1 (prefill) and aiter's op, not the
    decode layer 0 whose K nobody reads. A model that reads aiter's missing K fails to compile
    with the same message."""
    aiter = backends.get("aiter")
    graph = capture(Toy(decode_ok, prefill_ok), *toy_inputs())
    assert passes.fuse_rope_concat_cache(graph, REF) == {0: 1, 1: 1}
    swapped = 0
    for node in graph.nodes:
        if is_auto_functionalized(node) and op_name(node) == FUSED:
            node.args = (aiter_ops.fused_rope_concat_cache_write.default, *node.args[1:])
            swapped += 1
    assert swapped == 2
    with pytest.raises(LintError, match="returns no K on backend 'aiter'.*consumed") as info:
        lints.lint_backend_ops(graph, aiter)
    assert f"layer 1 ({AITER_FUSED}" in str(info.value) and "layer 0" not in str(info.value)
    with raises_from_compile(LintError, "returns no K on backend 'aiter'", f"layer 1 \\({AITER_FUSED}"):
        compile_toy(aiter_decode_ok, aiter_fused_k_read, attention_backend="aiter")


def test_aiter_ops_are_foreign_to_other_backends():
    """aiter's ops in a triton- or reference-backend graph are rejected, naming the owner."""
    graph = capture(Toy(aiter_decode_ok), *toy_inputs(1))
    for other in ("triton", "reference"):
        with pytest.raises(LintError, match=f"private to backend 'aiter', not '{other}'"):
            lints.lint_backend_ops(graph, backends.get(other))
    lints.lint_backend_ops(graph, backends.get("aiter"))


def test_backend_inferred_from_graph_ops():
    """By name with no backend given, a graph's private ops name its backend: aiter's decode
    graph is aiter's, and a triton graph is triton's, although aiter maps triton's ops as
    fallbacks (they stay triton's private ops)."""
    for name in ("triton", "aiter"):
        (m,) = same_weights("v3", name)
        setup, batch = scenario(m, "decode")
        caches = m.allocate_caches(8, PAGE)
        for b in setup:
            m(b, caches)
        torch._dynamo.reset()
        torch.compile(m, backend="mlagraph_eager", fullgraph=True)(batch, caches)
        assert passes.last_compile().backend == name


# ---------------------------------------------------------------------------------------------
# (a) triton and aiter models in one process, FX graph cache on, both orders


def inductor_step(name: str, kind: str, base: DeepseekForCausalLM, calls: Counter) -> dict:
    """Compiles ``base``'s weights on backend ``name`` with Inductor and runs one batch of
    ``kind``. The oracle is the REFERENCE backend's eager model (``base``) on the same caches."""
    m = DeepseekForCausalLM.from_config(tiny_config(), init_std=0.2, backend=name)
    m.load_state_dict(base.state_dict())
    setup, batch = scenario(m, kind)
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        base(b, caches)
    want = base(batch, clone_caches(caches))
    torch._dynamo.reset()
    prev, before = passes.last_compile(), Counter(calls)
    cache0 = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
    t0 = time.perf_counter()
    step = mlagraph.compile(m, backend="mlagraph", fullgraph=True)
    out = step(batch, caches)
    return dict(
        name=name, kind=kind, out=out, want=want, seconds=time.perf_counter() - t0, report=passes.last_compile(),
        graphs=step.num_graphs,  # the step's regions: each one a lookup in the FX graph cache
        new_report=passes.last_compile() is not prev and passes.last_compile().backend == name,
        calls=Counter({k: calls[k] - before[k] for k in calls}),
        cache={k: counters["inductor"][f"fxgraph_cache_{k}"] - n for k, n in cache0.items()},
    )


def runs_its_own_backend(r: dict) -> list[str]:
    """Problems with one compile: its own fused op (not the other's) in its graph, its own
    fused and decode kernels run, the other's never, and the reference backend's logits."""
    problems = []
    own, other = ("aiter", "triton") if r["name"] == "aiter" else ("triton", "aiter")
    own_op, other_op = (AITER_FUSED, TRITON_FUSED) if own == "aiter" else (TRITON_FUSED, AITER_FUSED)
    if r["new_report"]:
        after = r["report"].after
        foreign = backends.get(other).owned_ops() - set(backends.get(own).op_names.values())
        if text(own_op) not in after or text(other_op) in after or any(text(q) in after for q in foreign):
            problems.append(f"{own}: wrong ops in its graph:\n{after}")
    if r["calls"][f"{own}_fused"] != 1 or r["calls"][f"{own}_decode"] != (r["kind"] == "decode"):
        problems.append(f"{own}: its own kernels ran {dict(r['calls'])}")
    if r["calls"][f"{other}_fused"] or r["calls"][f"{other}_decode"]:
        problems.append(f"{own}: ran {other}'s kernels: {dict(r['calls'])}")
    if not torch.allclose(r["out"], r["want"], atol=1e-4, rtol=0):
        problems.append(f"{own}: logits differ from the reference backend by {(r['out'] - r['want']).abs().max()}")
    return problems


@pytest.mark.parametrize("kind", ["chunked_prefill", "decode"])
@pytest.mark.parametrize("order", [("triton", "aiter"), ("aiter", "triton")], ids=["triton_first", "aiter_first"])
def test_fx_graph_cache_keeps_triton_and_aiter_apart(order, kind, kernel_calls, tmp_path, monkeypatch):
    """Seed failure (a): Inductor with the FX graph cache on (fresh directory); the same weights
    compiled for triton and for aiter in one process, in both orders. Each compile misses the
    cache (different pass-manager uuids), has only its own fused op in its graph, runs only its
    own kernels and matches the reference backend; compiling the first again hits the cache
    and still runs its own kernels. Chunked prefill is the sharp case: before the passes the
    two backends' graphs are IDENTICAL (both use triton's cache read and MHA), so only the
    uuid keeps them apart (test_fx_graph_cache_check_has_teeth)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (base,) = same_weights(tiny_config(), "reference")
    results = []
    with torch._inductor.config.patch(fx_graph_cache=True):
        for name in order:
            results.append(inductor_step(name, kind, base, kernel_calls))
            n = results[-1]["graphs"]
            assert results[-1]["new_report"] and results[-1]["cache"] == {"hit": 0, "miss": n, "bypass": 0}
        again = inductor_step(order[0], kind, base, kernel_calls)
    for r in results:
        assert runs_its_own_backend(r) == []
    n = again["graphs"]
    assert again["cache"] == {"hit": n, "miss": 0, "bypass": 0} and not again["new_report"]
    assert runs_its_own_backend(again) == []
    print("inductor compile seconds:", {r["name"]: round(r["seconds"], 1) for r in results},
          "cache hit:", round(again["seconds"], 1))


def test_fx_graph_cache_check_has_teeth(kernel_calls, tmp_path, monkeypatch):
    """With a pass-manager uuid that ignores the backend (the seed bug), aiter's chunked-prefill
    compile is handed triton's cached graph (identical before the passes): it runs triton's
    fused kernel, and the check above reports exactly that (the logits still match: triton's
    graph is correct, for triton)."""
    from mlagraph.passes import MLAPassManager

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(MLAPassManager, "uuid", lambda self: b"mlagraph-passes-same-for-every-backend")
    (base,) = same_weights(tiny_config(), "reference")
    with torch._inductor.config.patch(fx_graph_cache=True):
        first = inductor_step("triton", "chunked_prefill", base, kernel_calls)
        second = inductor_step("aiter", "chunked_prefill", base, kernel_calls)
    assert runs_its_own_backend(first) == []
    assert second["cache"]["hit"] == second["graphs"] and not second["new_report"]
    problems = runs_its_own_backend(second)
    assert any("its own kernels ran" in p for p in problems) and any("ran triton's kernels" in p for p in problems)


# ---------------------------------------------------------------------------------------------
# (c) the triton backend's decode never reaches aiter, whatever the environment says


AITER_ENV = {
    "SGLANG_USE_AITER": "1", "SGLANG_ROCM_FUSED_DECODE_MLA": "1", "SGLANG_AITER_MLA": "1",
    "VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MLA": "1", "VLLM_ATTENTION_BACKEND": "ROCM_AITER_MLA",
    "MLAGRAPH_BACKEND": "aiter", "MLAGRAPH_ATTENTION_BACKEND": "aiter", "USE_AITER": "1",
}
DECODE_PLANS = [BatchPlan(BatchKind.DECODE, 1, False), BatchPlan(BatchKind.MULTI_TOKEN_DECODE, 3, False),
                BatchPlan(BatchKind.DECODE, 1, True, dsa_dense=True), BatchPlan(BatchKind.DECODE, 1, True)]


@contextlib.contextmanager
def aiter_environment(monkeypatch):
    for k, v in AITER_ENV.items():
        monkeypatch.setenv(k, v)
    yield


def test_decode_dispatch_ignores_aiter_environment(monkeypatch):
    """Seed failure (c), the dispatch half: with every aiter switch of the field set, the
    methods the triton and aiter tables choose for decode plans are the same as without, and
    differ where the tables do (triton decodes multi-token steps itself, aiter cannot)."""
    tables = {n: backends.get(n).capabilities for n in ("triton", "aiter")}
    clean = {(n, p): choose_forward_method(c, p) for n, c in tables.items() for p in DECODE_PLANS}
    with aiter_environment(monkeypatch):
        assert {(n, p): choose_forward_method(c, p) for n, c in tables.items() for p in DECODE_PLANS} == clean
    multi = DECODE_PLANS[1]
    assert clean[("triton", multi)] is ForwardMethod.ABSORBED and clean[("aiter", multi)] is ForwardMethod.MHA_PREFIX


@pytest.mark.parametrize("s_q", [1, 3])
def test_triton_decode_never_runs_aiter(s_q, monkeypatch, kernel_calls):
    """Seed failure (c), end to end: with the aiter environment set, a triton model's decode
    step (single- and multi-token) runs triton's decode, eagerly and compiled, and no aiter
    op or kernel at all; the aiter model with the same weights runs aiter's decode for s_q = 1
    (and MHA over the prefix for s_q = 3), and both equal the reference backend."""
    ref, tri, ait = same_weights("v3", "reference", "triton", "aiter")
    with aiter_environment(monkeypatch):
        outs = {}
        for m in (ref, tri, ait):
            caps = m.backend.capabilities
            caches = m.allocate_caches(16, PAGE)
            prefill = build_batch(caps, [[3, 14, 15, 92, 65], [89, 79, 32]], [0, 0], [[0, 1, 2], [3, 4, 5]], PAGE)
            decode = build_batch(caps, [[7] * s_q, [8] * s_q], [5, 3], [[0, 1, 2], [3, 4, 5]], PAGE,
                                 is_decode=[True, True])
            m(prefill, caches)
            seen = OpsSeen()
            with seen:
                eager = m(decode, clone_caches(caches))
            torch._dynamo.reset()
            compiled = mlagraph.compile(m, backend="mlagraph_eager", fullgraph=True, strict=True)(decode, caches)
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)
            outs[m.backend.name] = (eager, decode.method, set(seen.names), passes.last_compile().after)
    for name in ("triton", "aiter"):
        torch.testing.assert_close(outs[name][0], outs["reference"][0], atol=1e-4, rtol=0)
    _, method, seen, after = outs["triton"]
    assert method is ForwardMethod.ABSORBED
    assert "mlagraph_triton::mla_decode" in seen and not any(n.startswith("mlagraph_aiter::") for n in seen)
    assert "mlagraph_triton.mla_decode(" in after and "mlagraph_aiter" not in after
    assert text(TRITON_FUSED) in after
    _, method, seen, after = outs["aiter"]
    if s_q == 1:
        assert method is ForwardMethod.ABSORBED and AITER_DECODE in seen and text(AITER_DECODE) in after
        assert kernel_calls["aiter_decode"] == 2 * 2  # 2 layers, eager + compiled
    else:
        assert method is ForwardMethod.MHA_PREFIX and not any(n.startswith("mlagraph_aiter::mla") for n in seen)
        assert kernel_calls["aiter_decode"] == 0
    assert text(AITER_FUSED) in after and "mlagraph_triton.fused" not in after
    # the triton model ran its own decode kernel 2 layers x (eager + compiled), never aiter's;
    # aiter's fused kernel ran only in the aiter model's compiled step (2 layers)
    assert kernel_calls["triton_decode"] == 4 and kernel_calls["aiter_fused"] == 2


def test_capability_tables_are_frozen_and_distinct():
    """Nothing at run time can turn one table into the other (lesson 1)."""
    tri, ait = backends.get("triton").capabilities, backends.get("aiter").capabilities
    with pytest.raises(dataclasses.FrozenInstanceError):
        tri.fused_returns_k = False
    assert tri.fused_returns_k and not ait.fused_returns_k
    assert tri.decode_q_split and not ait.decode_q_split
