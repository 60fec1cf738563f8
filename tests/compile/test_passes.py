"""The compile integration: fusion and concat elimination per layer, reports, strict mode, the
graph lints (each with a broken graph it must reject), the pass manager's uuid and Inductor's
FX graph cache across two backends, and the dynamo backends by name.

Most compiles use ``backend="mlagraph_eager"`` (the same passes on the AOT graph, no code
generation); Inductor (``"mlagraph"``) is used only where the test is about Inductor. Broken
graphs come from small hand-written modules whose layers sit under ``layers.N`` (so the lints
can name the layer), captured exactly as ``mlagraph_eager`` hands them to the pass manager.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import time
import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import mlagraph
from mlagraph import passes
from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.attention import KVCaches
from mlagraph.model.batch import BatchKind, ForwardMethod, build_batch
from mlagraph.ops import backends
from mlagraph.ops.rope import rope_cos_sin_cache
from mlagraph.passes import FusionNotApplied, LintError, MLAPassManager, PassRecord, lints
from mlagraph.passes.graph_utils import is_auto_functionalized, op_name
from tests.model.conftest import hf_config

from .fake_backend import CALLS, FAKE_AITER, FAKE_OP, aiter_like, fake_aiter, registered_backend  # noqa: F401

mg = torch.ops.mlagraph
FUSED = "mlagraph::fused_rope_concat_cache_write"
PAGE = 4
KINDS = ("prefill", "chunked_prefill", "decode", "multi_token_decode")
DECODE_KINDS = ("decode", "multi_token_decode")
PLAN = {  # kind -> (BatchKind, ForwardMethod on the reference backend, V3)
    "prefill": (BatchKind.PREFILL, ForwardMethod.MHA),
    "chunked_prefill": (BatchKind.CHUNKED_PREFILL, ForwardMethod.MHA_PREFIX),
    "decode": (BatchKind.DECODE, ForwardMethod.ABSORBED),
    "multi_token_decode": (BatchKind.MULTI_TOKEN_DECODE, ForwardMethod.ABSORBED),
}


@pytest.fixture(autouse=True)
def _clean_state():
    """Fresh dynamo state per test, and no backend registered by a test may outlive it."""
    torch._dynamo.reset()
    before = backends.names()
    yield
    assert backends.names() == before, "a test left a backend registered"


def inner(exc: BaseException) -> BaseException:
    """The exception a compiler backend raised (dynamo wraps it in BackendCompilerFailed)."""
    return getattr(exc, "inner_exception", exc)


def raises_from_compile(exc_type, *patterns):
    """pytest.raises for an error raised inside the backend; every pattern must be in its text."""

    class _Ctx:
        def __enter__(self):
            self._raises = pytest.raises(Exception)
            self.info = self._raises.__enter__()
            return self

        def __exit__(self, *exc):
            suppressed = self._raises.__exit__(*exc)
            err = inner(self.info.value)
            assert isinstance(err, exc_type), f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
            for p in patterns:
                assert re.search(p, str(err)), f"{p!r} not in: {err}"
            self.error = err
            return suppressed

    return _Ctx()


# ---------------------------------------------------------------------------------------------
# whole models: batches of every kind


_MODELS: dict = {}
_RUNS: dict = {}


def model(kind: str, backend: str = "reference") -> DeepseekForCausalLM:
    key = (kind, backend)
    if key not in _MODELS or backend != "reference":
        _MODELS[key] = DeepseekForCausalLM.from_config(hf_config(kind), init_std=0.2, backend=backend)
    return _MODELS[key]


def clone_caches(c: KVCaches) -> KVCaches:
    return dataclasses.replace(
        c,
        latent=[t.clone() for t in c.latent],
        scale=None if c.scale is None else c.scale.clone(),
        index=None if c.index is None else [t.clone() for t in c.index],
    )


def all_caches(c: KVCaches) -> list[torch.Tensor]:
    return list(c.latent) + list(c.index or [])


def scenario(m: DeepseekForCausalLM, kind: str):
    """(batches to run eagerly first, the batch under test): two requests of a given kind.

    Chunked prefill and decode kinds first write a 6- and a 4-token prompt, so the batch under
    test runs over a cached prefix (prefix_lens > 0).
    """
    caps, dsa = m.backend.capabilities, m.config.uses_dsa
    pages = [[0, 1, 2, 3], [4, 5, 6, 7]]

    def mk(tokens, prefix, decode=False):
        return build_batch(caps, tokens, prefix, pages, PAGE, is_decode=[decode] * 2, dsa=dsa)

    prompts = [[3, 14, 15, 92, 65, 35], [89, 79, 32, 38]]
    if kind == "prefill":
        return [], mk(prompts, [0, 0])
    first = mk(prompts, [0, 0])
    if kind == "chunked_prefill":
        return [first], mk([[1, 2, 3, 4], [5, 6, 7]], [6, 4])
    if kind == "decode":
        return [first], mk([[7], [8]], [6, 4], decode=True)
    if kind == "multi_token_decode":
        return [first], mk([[7, 8, 9], [10, 11, 12]], [6, 4], decode=True)
    raise ValueError(kind)


@dataclasses.dataclass
class Run:
    batch: object
    eager: torch.Tensor
    compiled: torch.Tensor
    before: list[torch.Tensor]  # caches before the batch
    eager_caches: list[torch.Tensor]
    compiled_caches: list[torch.Tensor]
    report: passes.CompileReport
    lints_ran: list[str]


def compiled_vs_eager(m: DeepseekForCausalLM, kind: str) -> Run:
    """Runs one batch eagerly and compiled (mlagraph_eager, strict: lints on) from equal caches.

    Static shapes (3x quicker to compile); test_reports_accumulate_newest_last compiles with
    dynamic=True and expects the same records. The whole-model step (``regional=False``): one
    graph holding every layer's ops, which the per-layer counts of these tests read; the
    regional step's graphs (each layer kind once) are checked in test_regional.py and the goldens.
    """
    setup, batch = scenario(m, kind)
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        m(b, caches)
    eager_caches, compiled_caches = clone_caches(caches), clone_caches(caches)
    eager = m(batch, eager_caches)

    ran = []

    def spy(name, lint):
        def run_lint(graph, backend):
            ran.append(name)
            return lint(graph, backend)
        return run_lint

    spied = {name: spy(name, lint) for name, lint in lints.LINTS.items()}
    torch._dynamo.reset()
    prev = passes.last_compile()
    with mock.patch.dict(lints.LINTS, spied):
        cm = mlagraph.compile(m, backend="mlagraph_eager", fullgraph=True, dynamic=False, strict=True,
                              regional=False)
        out = cm(batch, compiled_caches)
    report = passes.last_compile()
    assert report is not prev, "the pass manager did not run"
    return Run(batch, eager, out, all_caches(caches), all_caches(eager_caches), all_caches(compiled_caches),
               report, ran)


def run(model_kind: str, kind: str) -> Run:
    """Memoized: the count, equality and lint tests look at the same compiles."""
    if (model_kind, kind) not in _RUNS:
        _RUNS[(model_kind, kind)] = compiled_vs_eager(model(model_kind), kind)
    return _RUNS[(model_kind, kind)]


def records(graph: str, pass_name: str, layers) -> list[PassRecord]:
    return [PassRecord(graph, pass_name, layer, 1) for layer in layers]


@pytest.mark.parametrize("kind", KINDS)
def test_fusion_counts_per_layer_v3(kind):
    """V3 (2 layers, reference backend): every layer's RoPE -> cat -> cache write is fused once,
    in every batch kind; eliminate_concat fires once per layer in the absorbed decode graphs
    (single- and multi-token) and never in MHA prefill (with or without a cached prefix)."""
    r = run("v3", kind)
    assert (r.batch.plan.kind, r.batch.method) == PLAN[kind]
    g = r.report.graph
    expected = records(g, "fuse_rope_concat_cache", [0, 1])
    if kind in DECODE_KINDS:
        expected += records(g, "eliminate_concat", [0, 1])
    assert r.report.records == expected
    after = r.report.after
    assert after.count("mlagraph.fused_rope_concat_cache_write(") == 2
    assert "mlagraph.rope(" not in after and "mlagraph.latent_cache_write(" not in after
    assert r.report.before.count("mlagraph.rope(") == 2 and r.report.before.count("mlagraph.latent_cache_write(") == 2
    if kind in DECODE_KINDS:
        assert "aten.cat(" not in after  # q never materialized: the decode reads it split
    else:
        assert "aten.cat(" in after  # MHA's k = cat(k_nope, k_rot) stays; q comes from the fused op
        assert "mlagraph.mha_prefill(q=v" in after


@pytest.mark.parametrize("kind", KINDS)
def test_fusion_counts_per_layer_v32(kind):
    """V3.2 (DSA): every kind runs sparse MLA over the latent cache (absorbed), so both passes
    fire once per layer; the indexer's own RoPE (NeoX) and key cache write are left alone."""
    r = run("v32", kind)
    assert r.batch.method is ForwardMethod.SPARSE
    g = r.report.graph
    assert r.report.records == records(g, "fuse_rope_concat_cache", [0, 1]) + records(g, "eliminate_concat", [0, 1])
    after = r.report.after
    assert after.count("mlagraph.fused_rope_concat_cache_write(") == 2
    assert after.count("mlagraph.rope(") == 2 and all("interleaved=False" in line for line in after.splitlines()
                                                        if "mlagraph.rope(" in line)
    assert after.count("mlagraph.indexer_cache_write(") == 2


@pytest.mark.parametrize("model_kind", ["v3", "v32"])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_equals_eager(model_kind, kind):
    """Compiled (mlagraph_eager, passes applied) logits equal eager logits within 1e-5, and the
    caches the step wrote are equal (latent, and indexer keys for V3.2) — and were written."""
    r = run(model_kind, kind)
    torch.testing.assert_close(r.compiled, r.eager, atol=1e-5, rtol=0)
    for before, e, c in zip(r.before, r.eager_caches, r.compiled_caches):
        assert not torch.equal(e, before), "the batch wrote nothing to this cache"
        torch.testing.assert_close(c, e, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model_kind", ["v3", "v32"])
@pytest.mark.parametrize("kind", KINDS)
def test_lints_pass_on_model_graphs(model_kind, kind):
    """All three lints run (once each, after the passes) and pass on full V3 and V3.2 model
    graphs of every batch kind: the compile is strict, so a failing lint would have raised."""
    r = run(model_kind, kind)
    assert sorted(r.lints_ran) == sorted(lints.LINTS)
    assert r.report.backend == "reference"


def test_reports_accumulate_newest_last():
    """reports() keeps every compile's records in order (newest last); last_report() holds only
    the newest compile's; each record has .graph str, .pass_name str, .layer int|None, .count
    int, and one compile's records share one graph name. Compiled with dynamic shapes: the
    passes match the same per-layer sequences with symbolic token counts."""
    m = model("v3")
    n0 = len(passes.reports())
    outs = []
    for kind in ("prefill", "decode"):
        torch._dynamo.reset()
        setup, batch = scenario(m, kind)
        caches = m.allocate_caches(8, PAGE)
        for b in setup:
            m(b, caches)
        mlagraph.compile(m, backend="mlagraph_eager", fullgraph=True, dynamic=True)(batch, caches)
        outs.append(passes.last_report())
    first, second = outs
    assert len(first) == 2 and len(second) == 4
    assert passes.reports()[n0:] == first + second
    assert passes.last_report() == second
    for recs in (first, second):
        assert len({r.graph for r in recs}) == 1
    g1, g2 = first[0].graph, second[0].graph
    assert g1 != g2 and g1.startswith("reference#") and int(g2.split("#")[1]) > int(g1.split("#")[1])
    for r in first + second:
        assert type(r.graph) is str and type(r.pass_name) is str and type(r.count) is int
        assert r.layer is None or type(r.layer) is int
        assert r.pass_name in ("fuse_rope_concat_cache", "eliminate_concat") and r.count >= 1
    assert passes.last_compile().records == second


# ---------------------------------------------------------------------------------------------
# hand-written layers (broken on purpose): T tokens of T one-token requests, H heads, latent L


T, H, DN, L, R = 3, 2, 4, 8, 4


class _Attn(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, cache):
        return self.body(x, cache)


class _Layer(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.self_attn = _Attn(body)

    def forward(self, x, cache):
        return self.self_attn(x, cache)


class Toy(nn.Module):
    """Layer i (module path ``layers.i.self_attn``) runs ``bodies[i](x, caches[i])``."""

    def __init__(self, *bodies):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(b) for b in bodies)

    def forward(self, x: dict, caches: list):
        return [layer(x, caches[i]) for i, layer in enumerate(self.layers)]


def toy_inputs(n_layers: int = 2, seed: int = 0):
    """Three requests decoding one token each at positions 5, 2, 7 (pages 2b, 2b+1 of size 4)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    positions = torch.tensor([5, 2, 7])
    block_table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    slots = torch.tensor([int(block_table[b, p // PAGE]) * PAGE + int(p) % PAGE for b, p in enumerate(positions)])
    x = dict(
        q_nope=r(T, H, DN), q_lat=r(T, H, L), q_pe=r(T, H, R), kv_c=r(T, L), k_pe=r(T, 1, R),
        k_nope=r(T, H, DN), v=r(T, H, DN), positions=positions, cos_sin=rope_cos_sin_cache(R, 16, 10000.0),
        slots=slots, block_table=block_table, seq_lens=(positions + 1).to(torch.int32),
        cu=torch.tensor([0, T], dtype=torch.int32),
    )
    caches = [r(6, PAGE, L + R) for _ in range(n_layers)]
    return x, caches


def _decode(x, q_nope, q_pe, cache):
    o, _ = mg.mla_decode(q_nope.reshape(T, 1, H, L), q_pe.reshape(T, 1, H, R), cache, x["block_table"],
                         x["seq_lens"], None, "bf16", 0.5)
    return o


def _rope(x, q_pe=None, k_pe=None):
    q_pe = x["q_pe"] if q_pe is None else q_pe
    k_pe = x["k_pe"] if k_pe is None else k_pe
    return mg.rope(q_pe, k_pe, x["positions"], x["cos_sin"], True)


def _write(x, k, cache):
    mg.latent_cache_write(x["kv_c"], k, cache, x["slots"], None, "bf16")


def _fused(x, q_nope, q_pe=None, k_pe=None, op=mg.fused_rope_concat_cache_write, cache=None):
    q_pe = x["q_pe"] if q_pe is None else q_pe
    k_pe = x["k_pe"] if k_pe is None else k_pe
    return op(q_nope, q_pe, x["kv_c"], k_pe, x["positions"], x["cos_sin"], cache, x["slots"], None, "bf16", True)


def decode_ok(x, cache):
    """The model's absorbed-decode front: RoPE -> cat -> write, then decode reading q split."""
    q_rot, k_rot = _rope(x)
    q = torch.cat([x["q_lat"], q_rot], dim=-1)
    _write(x, k_rot[:, 0], cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def prefill_ok(x, cache):
    """The model's MHA prefill front: RoPE -> cat -> write; K = cat(k_nope, rotated k_pe)."""
    q_rot, k_rot = _rope(x)
    q = torch.cat([x["q_nope"], q_rot], dim=-1)
    _write(x, k_rot[:, 0], cache)
    k = torch.cat([x["k_nope"], k_rot.expand(T, H, R)], dim=-1)
    out, _ = mg.mha_prefill(q, k, x["v"], x["cu"], x["cu"], 0.5, True)
    return out


def decode_no_cat(x, cache):
    """Rotated once, written once, but q is never concatenated: nothing for the fusion to match."""
    q_rot, k_rot = _rope(x)
    _write(x, k_rot[:, 0], cache)
    return _decode(x, x["q_lat"], q_rot, cache)


def decode_unrotated_write(x, cache):
    """BROKEN: the cache gets the raw k_pe (RoPE skipped for K)."""
    q_rot, _ = _rope(x)
    q = torch.cat([x["q_lat"], q_rot], dim=-1)
    _write(x, x["k_pe"][:, 0], cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def decode_unrotated_q(x, cache):
    """BROKEN: the decode reads the raw q_pe (RoPE skipped for q)."""
    _, k_rot = _rope(x)
    _write(x, k_rot[:, 0], cache)
    return _decode(x, x["q_lat"], x["q_pe"], cache)


def decode_rope_twice(x, cache):
    """BROKEN: RoPE applied to an already-rotated q_pe/k_pe."""
    q_rot, k_rot = _rope(x)
    q_rot, k_rot = _rope(x, q_rot, k_rot)
    q = torch.cat([x["q_lat"], q_rot], dim=-1)
    _write(x, k_rot[:, 0], cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def decode_rope_then_fused(x, cache):
    """BROKEN (lesson 2): RoPE applied, then the fused op that applies RoPE itself."""
    q_rot, k_rot = _rope(x)
    q, _ = _fused(x, x["q_lat"], q_rot, k_rot, cache=cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def prefill_fused_and_rope_for_k(x, cache):
    """BROKEN: the fused op rotates and writes, and a second RoPE rotates K again for MHA."""
    q, _ = _fused(x, x["q_nope"], cache=cache)
    _, k_rot = _rope(x)
    k = torch.cat([x["k_nope"], k_rot.expand(T, H, R)], dim=-1)
    out, _ = mg.mha_prefill(q, k, x["v"], x["cu"], x["cu"], 0.5, True)
    return out


def decode_written_twice(x, cache):
    """BROKEN: the fused op writes the cache, and latent_cache_write writes it again."""
    q, k = _fused(x, x["q_lat"], cache=cache)
    _write(x, k[:, 0], cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def decode_fake_aiter_op(x, cache):
    """The fake aiter op, called directly (its K output unused)."""
    q, _ = _fused(x, x["q_lat"], op=torch.ops.mlagraph_test.fused_qk_rope_cat_and_cache, cache=cache)
    return _decode(x, q[..., :L], q[..., L:], cache)


def decode_fake_aiter_op_reading_k(x, cache):
    """BROKEN on an aiter-like backend: reads the K the fused op does not return."""
    q, k = _fused(x, x["q_lat"], op=torch.ops.mlagraph_test.fused_qk_rope_cat_and_cache, cache=cache)
    return _decode(x, q[..., :L], q[..., L:], cache) + k.sum()


def capture(module: nn.Module, *args) -> torch.fx.Graph:
    """The graph mlagraph_eager hands to the pass manager (functional AOT form), no pass run:
    the whole-model step's (``regional=False``), every layer in one graph under its ``layers.N``."""
    seen = []
    call = MLAPassManager.__call__

    def spy(self, graph):
        seen.append(graph)
        return call(self, graph)

    torch._dynamo.reset()
    with mock.patch.object(MLAPassManager, "__call__", spy):
        mlagraph.compile(module, backend="mlagraph_eager", fullgraph=True, passes=(), lint=False, regional=False)(*args)
    assert len(seen) == 1
    return seen[0]


def compile_toy(*bodies, **kw):
    """Compiles Toy(*bodies) with mlagraph_eager and runs it; returns (compiled out, eager out)."""
    x, caches = toy_inputs(len(bodies))
    eager = Toy(*bodies)(x, [c.clone() for c in caches])
    torch._dynamo.reset()
    out = mlagraph.compile(Toy(*bodies), backend="mlagraph_eager", fullgraph=True, **kw)(x, caches)
    return out, eager


REF = backends.REFERENCE


def test_toy_graph_fuses_like_the_model():
    """Sanity for the hand-written layers: the correct decode and prefill fronts pass every
    lint, fuse once per layer (layer numbers from the ``layers.N`` module path) and match eager."""
    out, eager = compile_toy(decode_ok, prefill_ok, strict=True)
    g = passes.last_compile().graph
    assert passes.last_report() == records(g, "fuse_rope_concat_cache", [0, 1]) + records(g, "eliminate_concat", [0])
    for o, e in zip(out, eager):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# strict


@pytest.mark.parametrize("body", [decode_no_cat, decode_unrotated_write], ids=["no_cat", "unrotated_k"])
def test_strict_raises_when_requested_fusion_matches_nothing(body):
    """The reference table says fused_rope_cache=True, but no layer has the RoPE -> cat -> write
    sequence (q never concatenated; or the cache written with an un-rotated k_pe): strict=True
    raises FusionNotApplied naming the pass."""
    with raises_from_compile(FusionNotApplied, "fuse_rope_concat_cache", "matched in no layer"):
        compile_toy(body, body, strict=True)


def test_non_strict_warns_and_still_runs():
    """Without strict the same unmatched fusion is a UserWarning, and the graph still runs right."""
    with pytest.warns(UserWarning, match="requested fusion 'fuse_rope_concat_cache' matched in no layer"):
        out, eager = compile_toy(decode_no_cat, decode_no_cat)
    assert passes.last_report() == []
    for o, e in zip(out, eager):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)


def test_no_warning_when_backend_has_no_fusion():
    """A backend whose table has no fused op: nothing is fused, nothing is requested, so strict
    is silent — and the fusable graph keeps its RoPE, cat and write."""
    with registered_backend("nofuse", fused_rope_cache=False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, eager = compile_toy(decode_ok, prefill_ok, strict=True, attention_backend="nofuse")
    rep = passes.last_compile()
    assert rep.backend == "nofuse" and rep.records == records(rep.graph, "eliminate_concat", [0])
    assert "fused_rope" not in rep.after and rep.after.count("mlagraph.rope(") == 2
    for o, e in zip(out, eager):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# lints: each rejects a broken graph, naming the layer (1: layer 0 is a correct one) and the op


@pytest.mark.parametrize(
    "body, op, what",
    [
        (decode_rope_twice, "mlagraph::rope", "RoPE applied twice"),
        (decode_rope_then_fused, FUSED, "RoPE applied twice"),
        (prefill_fused_and_rope_for_k, "mlagraph::rope", "rotated 2 times"),
        (decode_unrotated_write, "mlagraph::latent_cache_write", "RoPE skipped.*k_pe is not rotated"),
        (decode_unrotated_q, "mlagraph::mla_decode", "RoPE skipped.*q_pe is not rotated"),
    ],
    ids=["rope_on_rotated", "fused_on_rotated", "k_rotated_again_for_mha", "cache_k_unrotated", "decode_q_unrotated"],
)
def test_lint_rope_once_rejects(body, op, what):
    """lint_rope_once: RoPE twice (on rotated inputs, or a fused op fed rotated values, or a
    second rotation of K for MHA beside the fused op) or skipped (cache or decode q unrotated)."""
    graph = capture(Toy(decode_ok, body), *toy_inputs())
    with pytest.raises(LintError, match=what) as info:
        lints.lint_rope_once(graph, REF)
    msg = str(info.value)
    assert "layer 1" in msg and op in msg and "layer 0" not in msg
    # the correct graph passes
    lints.lint_rope_once(capture(Toy(decode_ok, prefill_ok), *toy_inputs()), REF)


def test_lint_rope_once_runs_at_compile_time():
    """The lints run inside the compile (strict): a skipped RoPE fails the compile."""
    with raises_from_compile(LintError, "layer 1", "mlagraph::mla_decode", "q_pe is not rotated"):
        compile_toy(decode_ok, decode_unrotated_q, strict=True)


def test_lint_write_once_rejects_two_writes():
    """lint_write_once: a layer that writes its cache with the fused op AND latent_cache_write
    (in functional form the second write mutates the first one's output) is rejected, naming
    the layer and both ops; the same model compiled is rejected too."""
    graph = capture(Toy(decode_ok, decode_written_twice), *toy_inputs())
    with pytest.raises(LintError, match="written 2 times") as info:
        lints.lint_write_once(graph, REF)
    msg = str(info.value)
    assert f"layer 1 ({FUSED}" in msg and "layer 1 (mlagraph::latent_cache_write" in msg and "layer 0" not in msg
    lints.lint_write_once(capture(Toy(decode_ok, prefill_ok), *toy_inputs()), REF)
    with raises_from_compile(LintError, "lint_write_once", "layer 1"):
        compile_toy(decode_ok, decode_written_twice)


def test_lint_backend_ops_rejects_foreign_op(fake_aiter):
    """lint_backend_ops: the fake aiter op in a reference-backend graph is rejected, naming the
    layer, the op and its owner; on its own backend the same graph passes; compiled for the
    reference backend it fails; compiled by name with no backend given, the graph's private op
    picks the fake backend."""
    graph = capture(Toy(decode_ok, decode_fake_aiter_op), *toy_inputs())
    with pytest.raises(LintError, match="private to backend 'fake_aiter'") as info:
        lints.lint_backend_ops(graph, REF)
    assert f"layer 1 ({FAKE_OP}" in str(info.value)
    lints.lint_backend_ops(graph, fake_aiter)
    with raises_from_compile(LintError, "lint_backend_ops", f"layer 1 \\({FAKE_OP}"):
        compile_toy(decode_ok, decode_fake_aiter_op, attention_backend="reference")
    compile_toy(decode_ok, decode_fake_aiter_op, strict=True)
    assert passes.last_compile().backend == FAKE_AITER


def test_lint_backend_ops_rejects_consumed_missing_k(fake_aiter):
    """The seed bug (null-K GPU fault), prevented: a graph fused for a backend whose fused op
    returns K, then run with the aiter-like op that returns an empty K, still feeds that K to
    MHA prefill — lint_backend_ops rejects it naming the layer (1: prefill) and the op, and
    not the decode layer (0) whose K nobody reads. Compiling a model that reads the missing K
    fails at compile time."""
    graph = capture(Toy(decode_ok, prefill_ok), *toy_inputs())
    assert passes.fuse_rope_concat_cache(graph, REF) == {0: 1, 1: 1}
    lints.lint_backend_ops(graph, REF)
    fake_op = torch.ops.mlagraph_test.fused_qk_rope_cat_and_cache.default
    swapped = 0
    for node in graph.nodes:
        if is_auto_functionalized(node) and op_name(node) == FUSED:
            node.args = (fake_op, *node.args[1:])
            swapped += 1
    assert swapped == 2
    with pytest.raises(LintError, match="returns no K on backend 'fake_aiter'.*consumed") as info:
        lints.lint_backend_ops(graph, fake_aiter)
    assert f"layer 1 ({FAKE_OP}" in str(info.value) and "layer 0" not in str(info.value)
    with raises_from_compile(LintError, "returns no K", f"layer 1 \\({FAKE_OP}"):
        compile_toy(decode_ok, decode_fake_aiter_op_reading_k, attention_backend=FAKE_AITER)


# ---------------------------------------------------------------------------------------------
# the aiter-like backend on the whole model


@pytest.mark.parametrize("kind", KINDS)
def test_fake_aiter_model(kind, fake_aiter):
    """The aiter-like backend (fused op returns no K) on V3: decode kinds and chunked prefill
    (whose keys come back from the cache) fuse into its private op in every layer, and run it;
    plain MHA prefill, which reads the new tokens' rotated K directly, stays unfused rather than
    rotating K twice or reading the empty K — and strict does not call that a missed fusion.
    Logits and caches equal eager."""
    m = model("v3", FAKE_AITER)
    n_calls = CALLS[FAKE_OP]
    r = compiled_vs_eager(m, kind)
    torch.testing.assert_close(r.compiled, r.eager, atol=1e-5, rtol=0)
    for e, c in zip(r.eager_caches, r.compiled_caches):
        torch.testing.assert_close(c, e, atol=1e-6, rtol=0)
    assert r.report.backend == FAKE_AITER and FUSED not in r.report.after.replace(".", "::")
    if kind != "prefill":
        g = r.report.graph
        expected = records(g, "fuse_rope_concat_cache", [0, 1])
        if kind in DECODE_KINDS:
            expected += records(g, "eliminate_concat", [0, 1])
        assert r.report.records == expected
        assert r.report.after.count("mlagraph_test.fused_qk_rope_cat_and_cache(") == 2
        assert "mlagraph.rope(" not in r.report.after
        assert CALLS[FAKE_OP] - n_calls == 2
    else:
        assert r.report.records == []
        assert "mlagraph_test" not in r.report.after and r.report.after.count("mlagraph.rope(") == 2
        assert CALLS[FAKE_OP] == n_calls


# ---------------------------------------------------------------------------------------------
# uuid


def test_uuid_covers_backend_and_settings():
    """MLAPassManager.uuid(): equal for equal settings, different for another backend (another
    name, or the same name with another capability table) and for each setting the passes
    read (strict, lint, passes)."""
    base = MLAPassManager(REF).uuid()
    assert isinstance(base, bytes) and base == MLAPassManager(REF).uuid()
    assert MLAPassManager(REF, strict=False, lint=True, passes=None).uuid() == base
    variants = {
        "strict": MLAPassManager(REF, strict=True).uuid(),
        "no_lint": MLAPassManager(REF, lint=False).uuid(),
        "no_passes": MLAPassManager(REF, passes=()).uuid(),
        "fuse_only": MLAPassManager(REF, passes=("fuse_rope_concat_cache",)).uuid(),
    }
    with aiter_like() as be:
        variants["fake_aiter"] = MLAPassManager(be).uuid()
        assert MLAPassManager(be).uuid() == variants["fake_aiter"]
    with registered_backend("twin") as be:
        variants["twin_same_table"] = MLAPassManager(be).uuid()
    with registered_backend("twin", fused_returns_k=False) as be:
        variants["twin_no_k"] = MLAPassManager(be).uuid()
    with registered_backend("twin", op_names={"fused_rope_concat_cache_write": FAKE_OP}) as be:
        variants["twin_other_op"] = MLAPassManager(be).uuid()
    values = [base, *variants.values()]
    assert len(set(values)) == len(values), variants


# ---------------------------------------------------------------------------------------------
# Inductor: FX graph cache with two backends in one process


def tiny_config():
    """The smallest model: 1 layer, hidden 32 (V3 otherwise), so Inductor on CPU is quick."""
    cfg = hf_config("v3")
    cfg.num_hidden_layers = 1
    cfg.hidden_size = 32
    return cfg


def inductor_decode(backend_name: str) -> dict:
    """Compiles the tiny model for ``backend_name`` with Inductor (backend "mlagraph") and runs
    a decode batch. Returns what a check needs: logits, eager logits, the newest report, how
    many times the fake op ran, the FX graph cache counters, and the time taken."""
    m = DeepseekForCausalLM.from_config(tiny_config(), init_std=0.2, backend=backend_name)
    setup, batch = scenario(m, "decode")
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        m(b, caches)
    eager = m(batch, clone_caches(caches))
    torch._dynamo.reset()
    prev, n_calls = passes.last_compile(), CALLS[FAKE_OP]
    cache0 = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
    t0 = time.perf_counter()
    step = mlagraph.compile(m, backend="mlagraph", fullgraph=True)
    out = step(batch, caches)
    seconds = time.perf_counter() - t0
    new_report = passes.last_compile() is not prev
    return dict(
        name=backend_name, out=out, eager=eager, seconds=seconds, report=passes.last_compile(),
        graphs=step.num_graphs,  # the step's regions: each one a lookup in the FX graph cache
        new_report=new_report and passes.last_compile().backend == backend_name,
        fake_calls=CALLS[FAKE_OP] - n_calls,
        cache={k: counters["inductor"][f"fxgraph_cache_{k}"] - n for k, n in cache0.items()},
    )


def runs_its_own_backend(r: dict) -> list[str]:
    """Problems with one compile: it must have run mlagraph's passes for its own backend (not
    been handed another backend's cached graph), contain only its own fused op, run it, and
    match eager."""
    problems = []
    own, other = (FAKE_OP, FUSED) if r["name"] == FAKE_AITER else (FUSED, FAKE_OP)
    if not r["new_report"]:
        problems.append(f"{r['name']}: the passes did not run for it (graph {r['report'] and r['report'].graph})")
    else:
        after = r["report"].after
        if own.replace("::", ".") + "(" not in after or other.replace("::", ".") + "(" in after:
            problems.append(f"{r['name']}: wrong fused op in its graph:\n{after}")
    if r["fake_calls"] != (1 if r["name"] == FAKE_AITER else 0):
        problems.append(f"{r['name']}: the fake aiter op ran {r['fake_calls']} times")
    if not torch.allclose(r["out"], r["eager"], atol=1e-5, rtol=0):
        problems.append(f"{r['name']}: logits differ from eager")
    return problems


@pytest.mark.parametrize(
    "order", [("reference", FAKE_AITER), (FAKE_AITER, "reference")], ids=["ref_first", "aiter_first"]
)
def test_fx_graph_cache_keeps_backends_apart(order, fake_aiter, tmp_path, monkeypatch):
    """The seed failure: with Inductor's FX graph cache on (fresh cache dir), the same tiny
    model compiled for two backends in one process, in both orders, runs each backend's own
    fused op (both compiles miss the cache: the uuids differ) and matches eager; compiling the
    first again hits the cache (it is really in use, and the key is stable) and still runs the
    right op."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    results = []
    with torch._inductor.config.patch(fx_graph_cache=True):
        for name in order:
            results.append(inductor_decode(name))
            n = results[-1]["graphs"]
            assert results[-1]["cache"] == {"hit": 0, "miss": n, "bypass": 0}, results[-1]["cache"]
        again = inductor_decode(order[0])
    for r in results:
        assert runs_its_own_backend(r) == []
    assert again["cache"] == {"hit": again["graphs"], "miss": 0, "bypass": 0}, again["cache"]
    assert not again["new_report"]  # served from the cache: the passes did not run again ...
    assert again["fake_calls"] == (1 if order[0] == FAKE_AITER else 0)  # ... yet it runs its own op
    torch.testing.assert_close(again["out"], again["eager"], atol=1e-5, rtol=0)
    print("inductor compile seconds:", {r["name"]: round(r["seconds"], 1) for r in results},
          "cache hit:", round(again["seconds"], 1))


def test_fx_graph_cache_check_detects_a_uuid_without_the_backend(fake_aiter, tmp_path, monkeypatch):
    """The check above has teeth: with a uuid that ignores the backend (the seed bug), the
    second backend gets the first one's cached graph, and runs_its_own_backend reports it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(MLAPassManager, "uuid", lambda self: b"mlagraph-passes-same-for-every-backend")
    with torch._inductor.config.patch(fx_graph_cache=True):
        first = inductor_decode("reference")
        second = inductor_decode(FAKE_AITER)
    assert runs_its_own_backend(first) == []
    assert second["cache"]["hit"] == second["graphs"]
    problems = runs_its_own_backend(second)
    assert any("passes did not run" in p for p in problems) and any("ran 0 times" in p for p in problems)


# ---------------------------------------------------------------------------------------------
# dynamo backends by name


def test_entry_points_registered():
    """pyproject's torch_dynamo_backends entry points name both backends, and dynamo lists them."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert eps.get("mlagraph") == "mlagraph.compiler:mlagraph_backend"
    assert eps.get("mlagraph_eager") == "mlagraph.compiler:mlagraph_eager_backend"
    assert {"mlagraph", "mlagraph_eager"} <= set(torch._dynamo.list_backends())


def test_torch_compile_by_name_eager():
    """torch.compile(model, backend="mlagraph_eager") by name runs the passes (reference backend
    found from the graph) and matches eager."""
    m = model("v3")
    setup, batch = scenario(m, "decode")
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        m(b, caches)
    eager = m(batch, clone_caches(caches))
    out = torch.compile(m, backend="mlagraph_eager", fullgraph=True)(batch, caches)
    rep = passes.last_compile()
    assert rep.backend == "reference" and rep.records == records(rep.graph, "fuse_rope_concat_cache", [0, 1]) + \
        records(rep.graph, "eliminate_concat", [0, 1])
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)


def test_torch_compile_by_name_honours_attention_backend_option(fake_aiter):
    """options={"attention_backend": ...} picks the backend whose passes run (the model itself is
    backend-neutral): its private op is fused in and runs; an unknown name is an error listing
    the known ones; other options are passed on."""
    m = model("v3")
    setup, batch = scenario(m, "decode")
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        m(b, caches)
    eager = m(batch, clone_caches(caches))
    n = CALLS[FAKE_OP]
    out = torch.compile(m, backend="mlagraph_eager", options={"attention_backend": FAKE_AITER})(batch, caches)
    rep = passes.last_compile()
    assert rep.backend == FAKE_AITER and rep.after.count("mlagraph_test.fused_qk_rope_cat_and_cache(") == 2
    assert CALLS[FAKE_OP] - n == 2
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
    torch._dynamo.reset()
    with raises_from_compile(ValueError, "unknown backend 'nope'", "known backends: .*reference"):
        torch.compile(m, backend="mlagraph_eager", options={"attention_backend": "nope"})(batch, caches)
    torch._dynamo.reset()
    with raises_from_compile(FusionNotApplied, "matched in no layer"):
        torch.compile(Toy(decode_no_cat), backend="mlagraph_eager", options={"strict": True})(*toy_inputs(1))


def test_torch_compile_by_name_inductor(fake_aiter):
    """torch.compile(model, backend="mlagraph") by name runs Inductor with the passes for the
    backend given in options, and matches eager."""
    m = DeepseekForCausalLM.from_config(tiny_config(), init_std=0.2)
    setup, batch = scenario(m, "decode")
    caches = m.allocate_caches(8, PAGE)
    for b in setup:
        m(b, caches)
    eager = m(batch, clone_caches(caches))
    n = CALLS[FAKE_OP]
    out = torch.compile(m, backend="mlagraph", options={"attention_backend": FAKE_AITER})(batch, caches)
    rep = passes.last_compile()
    assert rep.backend == FAKE_AITER and "mlagraph_test.fused_qk_rope_cat_and_cache(" in rep.after
    assert CALLS[FAKE_OP] - n == 1
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)


def test_registered_backend_is_removed():
    """registered_backend / the fixture leave the process-wide registry as they found it (even
    on error), and unregister refuses the reference backend and unknown names."""
    names = backends.names()
    with pytest.raises(RuntimeError):
        with registered_backend("temp", fused_returns_k=False) as be:
            assert backends.get("temp") is be and not be.capabilities.fused_returns_k
            raise RuntimeError
    assert backends.names() == names
    with pytest.raises(ValueError, match="unknown backend 'temp'"):
        backends.get("temp")
    with pytest.raises(ValueError, match="cannot be removed"):
        backends.unregister("reference")
    with pytest.raises(ValueError, match="unknown backend"):
        backends.unregister("temp")
    with aiter_like():
        with pytest.raises(ValueError, match="already registered"):
            with aiter_like():
                pass
    assert backends.names() == names


def test_lint_write_once_rejects_a_read_cache_that_is_never_written():
    """A layer whose decode reads a cache this step never wrote (the write was lost) fails,
    naming the layer and the op."""
    model = DeepseekForCausalLM.from_config(hf_config("v3"), init_std=0.2)
    caches = model.allocate_caches(16, 4)
    batch = build_batch(model.backend.capabilities, [[4], [5]], [3, 3], [[0], [1]], 4, is_decode=[True, True])
    captured = {}

    def capture(gm, example_inputs):
        captured["graph"] = gm.graph
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(batch, caches)
    graph = captured["graph"]
    writes = [n for n in graph.nodes if op_name(n) == "mlagraph::latent_cache_write"]
    assert len(writes) == 2
    graph.erase_node(writes[1])  # layer 1 loses its write
    with pytest.raises(mlagraph.passes.LintError, match=r"layer 1 \(mlagraph::mla_decode"):
        mlagraph.passes.lint_write_once(graph, model.backend)


def test_collecting_an_empty_sink_keeps_the_process_list():
    """An empty collecting() list equals an empty process list: leaving it must not unhook the
    process list (reports filed afterwards would go nowhere)."""
    from mlagraph.passes import manager

    saved = list(manager._REPORTS)
    manager.clear_reports()
    try:
        with manager.collecting():
            pass
        report = manager.CompileReport("x#0", "reference", [], "", "")
        manager._SINKS[-1].append(report)
        assert manager.last_compile() is report
    finally:
        manager._REPORTS[:] = saved
