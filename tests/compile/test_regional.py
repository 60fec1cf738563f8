"""Regional compilation (mlagraph/regional.py): one graph per kind of layer block, reused by
every layer of that kind, with the whole step's guarantees (passes and reports per layer, no
recompiles across sizes, equal results, engines that coexist).

CPU tests compile with ``mlagraph_eager`` (the same passes, no code generation); the GPU tests
(``-m gpu``) capture the regional step in CUDA graphs with Inductor.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.batch import build_batch
from mlagraph.regional import RegionalStep
from tests.model.conftest import VOCAB, hf_config

PAGE = 4


def _model(kind: str, layers: int, backend: str = "reference", **dims) -> DeepseekForCausalLM:
    if kind == "v4":
        from tests.model.test_oracle_v4 import v4_config

        cfg = v4_config(num_hidden_layers=layers, **dims).to_dict()
    else:
        cfg = hf_config(kind).to_dict() | {"num_hidden_layers": layers, **dims}
    return DeepseekForCausalLM.from_config(cfg, init_std=0.2, backend=backend)


def _compile(model, **kw):
    return mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True, **kw)


def _steps(model, batch_sizes=(2, 3, 5)) -> list:
    """Prefill, chunked prefill and decode batches of each size: (build_batch args) per step."""
    caps, dsa = model.backend.capabilities, model.config.uses_dsa
    out = []
    for n in batch_sizes:
        pages = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(n)]
        prompts = [list(range(1 + i, 5 + 2 * i)) for i in range(n)]
        out.append(build_batch(caps, prompts, [0] * n, pages, PAGE, dsa=dsa))
        done = [len(p) for p in prompts]
        out.append(build_batch(caps, [[7, 8]] * n, done, pages, PAGE, dsa=dsa))
        out.append(build_batch(caps, [[9]] * n, [d + 2 for d in done], pages, PAGE, is_decode=[True] * n, dsa=dsa))
    return out


def _run(step, model, batches) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    caches = model.allocate_caches(48, PAGE)
    with torch.no_grad():
        logits = [step(b, caches) for b in batches]
    return logits, caches.latent + (caches.index or [])


@pytest.mark.parametrize("kind", ["v2", "v3", "v32"])
def test_regional_equals_whole_and_eager(kind):
    """Logits and written caches of the regional step equal the whole-model step's and eager's,
    over prefill, chunked prefill and decode batches of three sizes."""
    model = _model(kind, 3)
    batches = _steps(model)
    eager, eager_caches = _run(model, model, batches)
    for regional in (True, False):
        step = _compile(model, regional=regional)
        assert isinstance(step, RegionalStep) is regional
        logits, caches = _run(step, model, batches)
        for got, want in zip(logits, eager):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for got, want in zip(caches, eager_caches):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_graphs_do_not_grow_with_depth():
    """A 2-layer and a 6-layer model compile the same number of graphs, one per region key,
    none twice across batch sizes (dynamic sizes, no recompiles); the 6-layer step's graphs hold
    one layer's fused front, while its report lists all six layers."""
    counts = {}
    for layers in (2, 6):
        model = _model("v3", layers)
        step = _compile(model)
        _run(step, model, _steps(model))
        assert set(step.graphs.values()) == {1}, step.graphs
        counts[layers] = step.num_graphs
        after = mlagraph.passes.last_compile().after
        assert after.count("mlagraph.fused_rope_concat_cache_write(") == 1, after
        assert {r.layer for r in mlagraph.passes.last_report()} == set(range(layers))
    # embed, head, dense MLP, MoE, and attention per variant (prefill, chunked, decode)
    assert counts[2] == counts[6] == 7


def test_last_report_lists_every_layer():
    """Each layer's records come from its kind's graph: a 4-layer decode step reports both passes
    in every layer, all from one attention graph; the text shows each region once, headed by
    the layers it serves."""
    model = _model("v3", 4)
    step = _compile(model, strict=True)
    decode = _steps(model, (2,))[2]
    _run(step, model, [decode])
    records = mlagraph.passes.last_report()
    assert [(r.pass_name, r.layer, r.count) for r in records] == (
        [("fuse_rope_concat_cache", i, 1) for i in range(4)] + [("eliminate_concat", i, 1) for i in range(4)])
    graph = step.regions[("attention", "mla", decode.variant)].report.graph
    assert {r.graph for r in records} == {graph}
    after = mlagraph.passes.last_compile().after
    headers = [line for line in after.splitlines() if line.startswith("# ")]
    assert headers == ["# embed", "# attention (mla): layers 0-3", "# mlp (dense): layer 0", "# mlp (moe): layers 1-3",
                       "# head"]


def test_later_variant_reports_shared_regions():
    """The MLP, embed and head graphs serve every variant: a decode step after a prefill compiles
    only its attention graph, and its report still covers every layer and region."""
    model = _model("v3", 2)
    step = _compile(model)
    prefill, _, decode = _steps(model, (2,))
    _run(step, model, [prefill])
    first = step.num_graphs
    _run(step, model, [decode])
    assert step.num_graphs == first + 1
    rep = mlagraph.passes.last_compile()
    assert rep.after.count("# ") == 5 and {r.layer for r in rep.records} == {0, 1}


def _decodes(model, sizes) -> list:
    """Decode batches of ``sizes`` requests, as CUDA-graph buckets are captured: largest first."""
    caps = model.backend.capabilities
    return [build_batch(caps, [[9]] * n, [5] * n, [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(n)], PAGE,
                        is_decode=[True] * n, dsa=model.config.uses_dsa) for n in sizes]


@pytest.mark.parametrize("regional", [True, False])
@pytest.mark.parametrize("kind", ["v3", "v32", "v4"])
def test_one_token_batch_reuses_the_graphs(kind, regional):
    """Buckets 8, 1, 2 in capture order: a step traced at 8 tokens serves the one-token decode
    (no size-1 specialisation anywhere in the model) and equals eager."""
    if kind == "v4":
        from tests.model.test_oracle_v4 import v4_config

        model = DeepseekForCausalLM.from_config(v4_config(num_hidden_layers=3).to_dict(), init_std=0.2)
    else:
        model = _model(kind, 2)
    step = _compile(model, regional=regional)
    batches = _decodes(model, (8, 1, 2))
    with torch.no_grad():
        got, want = ([f(b, model.allocate_caches(48, PAGE)) for b in batches] for f in (step, model))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert set(step.graphs.values()) == {1}, step.graphs


def test_captured_decode_batches_share_the_regions_with_prefill():
    """As an engine with CUDA graphs runs: the static decode batches of every bucket (largest
    first), then plain prefill batches. The embedding, MLP and head regions serve both: the
    static batch's tensors alias the buffers without being views, so no base guard fails."""
    from mlagraph.engine.cuda_graphs import StaticDecodeInputs

    model = _model("v3", 2)
    step = _compile(model)
    prefill, chunked, decode = _steps(model, (3,))
    inputs = StaticDecodeInputs(8, 8, "cpu")
    static = [inputs.batch(n, decode.method, decode.plan) for n in (8, 4, 2, 1)]
    assert all(b.input_ids._base is None for b in static)
    assert static[0].positions.data_ptr() == inputs.batch(1, decode.method, decode.plan).positions.data_ptr()
    _run(step, model, static + [prefill, chunked])
    assert set(step.graphs.values()) == {1}, step.graphs
    assert step.num_graphs == 7  # embed, head, dense MLP, MoE, attention x (decode, prefill, chunked)


def test_regional_false_and_plain_functions_compile_whole():
    model = _model("v3", 2)
    assert type(_compile(model, regional=False)).__name__ == "CompiledStep"
    fn = mlagraph.compile(lambda x: x + 1, backend="mlagraph_eager", attention_backend="reference")
    assert type(fn).__name__ == "CompiledStep" and torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="regional=True: expected a DeepSeek model"):
        RegionalStep(lambda x: x, None, {})


def test_v4_regions_per_attention_type():
    """DeepSeek-V4: one attention graph per layer type (sliding, CSA, HCA) and one MoE graph per
    routing (hash, learned) per variant kind, equal to the whole-model step."""
    from tests.model.test_oracle_v4 import v4_config

    cfg = v4_config(num_hidden_layers=5, layer_types=[
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"]).to_dict()
    model = DeepseekForCausalLM.from_config(cfg, init_std=0.2)
    caps = model.backend.capabilities
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    prefill = build_batch(caps, prompts, [0, 0], [[0, 1, 2], [3, 4, 5]], PAGE, dsa=True)
    decode = build_batch(caps, [[3], [4]], [9, 11], [[0, 1, 2], [3, 4, 5]], PAGE, is_decode=[True, True], dsa=True)
    results, steps = {}, {}
    for regional in (True, False):
        step = steps[regional] = _compile(model, regional=regional)
        caches = model.allocate_caches(16, PAGE)
        results[regional] = [step(b, caches) for b in (prefill, decode)]
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    graphs = steps[True].graphs
    assert set(graphs.values()) == {1}, graphs
    assert sorted(k[1] for k in graphs if k[0] == "attention") == sorted(cfg["layer_types"][:3] * 2)
    assert sorted(k[1] for k in graphs if k[0] == "mlp") == ["hash_moe", "moe"]
    assert {r.layer for r in mlagraph.passes.last_report()} <= set(range(5))


ENGINES = [  # (config kind, dims, page size): different shapes, so no region can serve another's layers
    ("v2", {}, 4), ("v3", {}, 16), ("v32", {}, 4), ("v3", {"hidden_size": 96, "kv_lora_rank": 48}, 8),
    ("v2_qlora", {"hidden_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2}, 2),
]


def test_regional_engines_coexist():
    """Five compiled engines (V2 / V3 / V3.2, different dims and page sizes) generate one after the
    other, then the first again: each region of each engine compiled exactly once, together far
    more graphs than one code object's recompile limit (8), and the first engine's tokens and
    graphs unchanged. Regions have code objects of their own: had they shared the layer
    method's, the ninth graph would have failed under fullgraph."""
    rnd = random.Random(0)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 9)]
    engines, first = [], None
    for i, (kind, dims, page) in enumerate(ENGINES):
        model = _model(kind, 2, **dims)
        engine = Engine(model, max_num_seqs=4, max_model_len=64, page_size=page, compile=True,
                        compile_backend="mlagraph_eager")
        outs = engine.generate(prompts, max_new_tokens=3, ignore_eos=True)
        (step,) = engine.runner.compiled
        assert isinstance(step, RegionalStep) and set(step.graphs.values()) == {1}, step.graphs
        assert engine.compiled_graphs == len(step.graphs) >= 6
        assert engine.startup.compile_s > 0 and engine.startup.capture_s == 0
        first = first or [o.token_ids for o in outs]
        engines.append(engine)
    assert sum(e.compiled_graphs for e in engines) > 3 * 8
    before = dict(engines[0].runner.compiled[0].graphs)
    assert [o.token_ids for o in engines[0].generate(prompts, max_new_tokens=3, ignore_eos=True)] == first
    assert engines[0].runner.compiled[0].graphs == before


# ---------------------------------------------------------------------------------------------
# Inductor and a one-request decode


def _is_decode_key(key) -> bool:
    """Whether a compiled step's graph key (regional: (block, kind, variant); whole-model:
    the variant) is a one-token decode variant's."""
    from mlagraph.model.batch import BatchKind, BatchPlan

    if isinstance(key, BatchPlan):
        return key.kind is BatchKind.DECODE
    return isinstance(key, tuple) and any(_is_decode_key(k) for k in key)


@pytest.mark.parametrize("kind,backend,regional", [
    ("v3", "reference", True), ("v3", "reference", False), ("v32", "reference", True), ("v4", "reference", True),
    ("v3", "triton", True), ("v4", "triton", True),
    ("v2", "reference", True),  # no q LoRA: q is a strided piece of the fused input projection
])
def test_inductor_one_request_decode_reuses_the_graphs(kind, backend, regional):
    """Under Inductor (not mlagraph_eager, which the other CPU tests use) a decode of one request
    after wider ones compiles nothing new. Inductor's lowering of a view of a tensor it cannot
    prove contiguous asks whether the token (or request) count is 1, which dynamo's
    size-oblivious tracing does not cover. So the model takes its views of contiguous tensors
    (k_pe's head axis, q's [B, s_q] split, V4's hyper-connection mixes) or none (V4's pair
    swap is a gather; the fused input projection's pieces are slices or as_strided),
    eliminate_concat splits the absorbed q on the bmm's own output, and the decode ops' fake
    outputs have their contiguous strides written out (ops/_define.dense_empty)."""
    model = _model(kind, 2, backend)
    step = mlagraph.compile(model, fullgraph=True, dynamic=True, regional=regional)
    caches = model.allocate_caches(48, PAGE)
    with torch.no_grad():
        for batch in _steps(model, batch_sizes=(3, 1, 2)):
            step(batch, caches)
    assert step.graphs and all(n == 1 for n in step.graphs.values()), step.graphs
    assert any(_is_decode_key(k) for k in step.graphs)


# GPU: the regional step captured whole in CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_gpu_regional_capture_equals_whole(kind):
    """Inductor, CUDA graphs over every bucket: the regional engine's tokens and logprobs equal the
    whole-model engine's, its graph count is independent of the buckets, and its start-up time
    splits into compile and capture."""
    cfg = hf_config(kind).to_dict() | {"num_hidden_layers": 4}
    model = DeepseekForCausalLM.from_config(cfg, init_std=0.2, device="cuda", backend="triton")
    rnd = random.Random(1)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 9, 3, 11)]
    outs = {}
    for regional in (True, False):
        engine = Engine(model, max_num_seqs=8, max_model_len=64, page_size=4, compile=True, cuda_graphs=True,
                        compile_options={"regional": regional}, progress=False)
        assert engine.startup.capture_s > 0 and engine.startup.compile_s > 0
        outs[regional] = engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
        step = engine.runner.compiled[0]
        # one graph per key, the bucket-1 capture included (test_inductor_one_request_decode_reuses_the_graphs)
        assert {k: n for k, n in step.graphs.items() if n != 1} == {}, step.graphs
        if regional:
            assert isinstance(step, RegionalStep)
            assert len(engine.graphs.graphs) == len(engine.graphs.buckets) * len(engine.graphs.methods)
        del engine
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-3, rtol=0)


def test_a_new_variants_first_step_counts_as_compile_time():
    """compile_seconds covers each batch variant's first step, as a whole-model step's does:
    regions compiled before are timed in it too (one that takes 0.05 s a call adds 0.05 s per
    layer), and later steps of a known variant add nothing."""
    model = _model("v3", 2)
    step = _compile(model)
    prefill, _, decode = _steps(model, batch_sizes=(2,))[:3]
    caches = model.allocate_caches(48, PAGE)
    with torch.no_grad():
        step(prefill, caches)
        mlp = step.regions[("mlp", model.model.layers[1].mlp_kind)]
        fast = mlp._fn

        def slow(*args):
            time.sleep(0.05)
            return fast(*args)

        mlp._fn = slow
        before, mlp_before = step.compile_seconds, mlp.seconds
        step(decode, caches)  # a new variant: its attention region compiles, the MLP ones run
        assert mlp.seconds - mlp_before >= 0.05 * sum(
            layer.mlp_kind == model.model.layers[1].mlp_kind for layer in model.model.layers)
        after = step.compile_seconds
        assert after > before
        step(decode, caches)  # known variant: nothing added
        assert step.compile_seconds == after
