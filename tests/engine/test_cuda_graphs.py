"""Graph-captured decode (Engine(cuda_graphs=True), mlagraph.engine.cuda_graphs).

On CPU: the static buffers (bucket padding, block-table rows rewritten only where they changed)
against build_batch, and the engine's graph path with the capture replaced by a direct call of
the model on the static batch (everything but the capture itself), against the plain engine.
On the H200 (``-m gpu``): real captures, eager and compiled, Inductor's reduce-overhead mode,
under ``torch.cuda.set_sync_debug_mode("error")``, against the engine without graphs and the
reference backend.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine, build_batch
from mlagraph.engine import cuda_graphs as graphs
from mlagraph.model.batch import BatchKind, BatchPlan, ForwardMethod
from mlagraph.ops import backends

from tests.model.conftest import VOCAB, hf_config


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


# --- buckets -----------------------------------------------------------------------------------


def test_default_buckets():
    assert graphs.default_buckets(8) == [1, 2, 4, 8]
    assert graphs.default_buckets(12) == [1, 2, 4, 8, 12]
    assert graphs.default_buckets(1) == [1]


def test_check_buckets():
    assert graphs.check_buckets([1, 32, 128, 32], 128) == [1, 32, 128]
    for bad in ([], [0], [129], [2.0], "12", [True]):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            graphs.check_buckets(bad, 128)


def test_decode_plans():
    caps = backends.get("reference").capabilities
    assert list(graphs.decode_plans(caps, dsa=False)) == [ForwardMethod.ABSORBED]
    plans = graphs.decode_plans(caps, dsa=True)
    assert list(plans) == [ForwardMethod.ABSORBED, ForwardMethod.SPARSE]
    assert plans[ForwardMethod.ABSORBED].dsa_dense and not plans[ForwardMethod.SPARSE].dsa_dense


# --- static buffers ----------------------------------------------------------------------------


def _fill_like_engine(inputs: graphs.StaticDecodeInputs, reqs, page_size: int, bucket: int):
    """reqs: [(token, cached, pages)] -> fills the buffers the way the engine does."""
    tokens = [t for t, _, _ in reqs]
    positions = [c for _, c, _ in reqs]
    slots = [p[c // page_size] * page_size + c % page_size for _, c, p in reqs]
    inputs.fill(tokens, positions, slots, [p for _, _, p in reqs], [c + 1 for c in positions], bucket=bucket)


def test_static_inputs_equal_build_batch():
    page_size, max_pages = 4, 6
    inputs = graphs.StaticDecodeInputs(8, max_pages, "cpu")
    caps = backends.get("reference").capabilities
    reqs = [(5, 9, [3, 7, 1]), (11, 0, [2]), (7, 20, [0, 4, 5, 6, 8, 9])]
    _fill_like_engine(inputs, reqs, page_size, bucket=4)
    plan = BatchPlan(BatchKind.DECODE, 1, False)
    got = inputs.batch(4, ForwardMethod.ABSORBED, plan)
    # build_batch pads to the same 4 requests (min_reqs) with the same padding rows
    want = build_batch(caps, [[t] for t, _, _ in reqs], [c for _, c, _ in reqs], [p for _, _, p in reqs],
                       page_size, is_decode=[True] * 3, min_reqs=4)
    assert got.plan == want.plan and got.method == want.method
    for name in ("input_ids", "positions", "slot_mapping", "req_ids", "seq_lens", "cu_seqlens_q", "cu_seqlens_k",
                 "logits_indices"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)
    width = want.block_table.shape[1]  # build_batch's table is as wide as the longest request
    torch.testing.assert_close(got.block_table[:, :width], want.block_table)
    assert (got.block_table[:, width:] == -1).all()


def test_static_block_table_rows_follow_requests():
    """Rows grow, shrink (a new request in a row) and are padded again, always exactly."""
    page_size, max_pages = 2, 5
    inputs = graphs.StaticDecodeInputs(4, max_pages, "cpu")
    rnd = random.Random(0)
    free = list(range(40))
    rnd.shuffle(free)
    steps = [
        [(1, 0, [free[0]]), (2, 3, [free[1], free[2]])],
        [(1, 2, [free[0], free[3]]), (2, 4, [free[1], free[2], free[4]])],  # both grow
        [(3, 1, [free[5]]), (2, 5, [free[1], free[2], free[4]])],  # row 0: a new, shorter request
        [(2, 6, [free[1], free[2], free[4], free[6]])],  # one request: row 1 becomes padding
        [(4, 9, [free[7], free[8], free[9], free[10], free[11]]), (5, 0, [free[12]]), (6, 1, [free[13]])],
    ]
    for reqs in steps:
        bucket = 4
        _fill_like_engine(inputs, reqs, page_size, bucket)
        table = inputs.batch(bucket, ForwardMethod.ABSORBED, BatchPlan(BatchKind.DECODE, 1, False)).block_table
        want = torch.full((bucket, max_pages), -1, dtype=torch.int32)
        for i, (_, _, pages) in enumerate(reqs):
            want[i, : len(pages)] = torch.tensor(pages)
        torch.testing.assert_close(table, want)


def test_static_inputs_reject_bad_sizes():
    inputs = graphs.StaticDecodeInputs(2, 3, "cpu")
    with pytest.raises(ValueError, match="bucket"):
        inputs.fill([1, 2, 3], [0, 0, 0], [0, 1, 2], [[0], [1], [2]], [1, 1, 1], bucket=2)
    with pytest.raises(ValueError, match=r"pages\[0\]"):
        inputs.fill([1], [0], [0], [[0, 1, 2, 3]], [1], bucket=1)


# --- the engine's graph path on CPU (the capture replaced by a direct call) ----------------------


class _DirectGraphs(graphs.DecodeGraphs):
    """DecodeGraphs whose "graphs" call the model on the static batch: every step of the graph
    path but the capture and replay themselves, so it runs on CPU."""

    def _setup(self):
        self.batches, self.replays = {}, []

    def _capture(self, bucket, method, batch):
        self.batches[(bucket, method)] = batch

    def _replay(self, bucket, method):
        self.replays.append((bucket, method))
        with torch.no_grad():
            return self._fn(self.batches[(bucket, method)], self._caches)


def _direct_graph_engine(model, buckets, **kw) -> Engine:
    engine = Engine(model, max_num_seqs=4, max_model_len=48, page_size=4, **kw)
    plans = graphs.decode_plans(model.backend.capabilities, model.config.uses_dsa)
    engine.runner.graphs = _DirectGraphs(model, engine.caches, buckets, plans, 12, "cpu", progress=False)
    return engine


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_graph_path_equals_plain_engine_cpu(kind):
    model = DeepseekForCausalLM.from_config(hf_config(kind))
    # V3.2's index_topk is 12: requests cross it while decoding, so both graph variants run
    prompts = _prompts(5, [3, 9, 14, 5, 2])  # the fifth waits, then decodes alone
    want = Engine(model, max_num_seqs=4, max_model_len=48, page_size=4).generate(prompts, max_new_tokens=6)
    engine = _direct_graph_engine(model, [1, 2, 4])
    got = engine.generate(prompts, max_new_tokens=6)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    used = set(engine.graphs.replays)
    assert {b for b, _ in used} == {1, 4}
    if kind == "v32":
        assert {m for _, m in used} == {ForwardMethod.ABSORBED, ForwardMethod.SPARSE}
    assert engine.allocator.num_free == engine.num_pages


def test_batch_above_largest_bucket_runs_without_graphs_cpu():
    model = DeepseekForCausalLM.from_config(hf_config("v3"))
    prompts = _prompts(6, [4, 6, 5])
    want = Engine(model, max_num_seqs=4, max_model_len=48, page_size=4).generate(prompts, max_new_tokens=4)
    engine = _direct_graph_engine(model, [2])
    got = engine.generate(prompts, max_new_tokens=4)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.graphs.replays == []  # three requests decode together until all finish


# --- engine arguments ----------------------------------------------------------------------------


def test_engine_graph_arguments_are_checked():
    model = DeepseekForCausalLM.from_config(hf_config("v3"))
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
        Engine(model, max_model_len=64, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes: given but cuda_graphs=False"):
        Engine(model, max_model_len=64, cuda_graph_batch_sizes=[1, 2])
    with pytest.raises(ValueError, match="compile_options.*compile=False"):
        Engine(model, max_model_len=64, compile_options={"passes": ()})
    with pytest.raises(ValueError, match="compile_options: expected a dict"):
        Engine(model, max_model_len=64, compile=True, compile_options=["passes"])


def test_compile_options_reach_the_passes():
    """passes=() compiles the step with the lints only: no fusion is recorded."""
    import mlagraph

    model = DeepseekForCausalLM.from_config(hf_config("v3"))
    prompts = _prompts(7, [5, 3])
    want = Engine(model, max_num_seqs=4, max_model_len=48, page_size=4).generate(prompts, max_new_tokens=3)
    mlagraph.passes.clear_reports()
    engine = Engine(model, max_num_seqs=4, max_model_len=48, page_size=4, compile=True,
                    compile_backend="mlagraph_eager", compile_options={"passes": ()})
    got = engine.generate(prompts, max_new_tokens=3)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert mlagraph.passes.reports() == []


# --- the H200 --------------------------------------------------------------------------------------


def _gpu_engine(path, backend="triton", **kw) -> Engine:
    model = DeepseekForCausalLM.from_pretrained(path, backend=backend, device="cuda", progress=False)
    kw.setdefault("max_num_seqs", 4)
    return Engine(model, max_model_len=128, page_size=16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_gpu_graphs_equal_no_graphs_and_reference(hf_checkpoint, kind, compile):
    """Greedy tokens with graphs == without graphs == reference backend (float32 weights; V3.2's
    requests start below index_topk=12 and cross it while decoding, so its dense and sparse
    graphs both replay)."""
    _, path = hf_checkpoint(kind)
    prompts = _prompts(8, [3, 9, 6])
    ref = _gpu_engine(path, "reference").generate(prompts, max_new_tokens=8)
    plain = _gpu_engine(path, compile=compile).generate(prompts, max_new_tokens=8)
    engine = _gpu_engine(path, compile=compile, cuda_graphs=True)
    methods = []
    run = engine.graphs.run
    engine.graphs.run = lambda method, *a: methods.append(method) or run(method, *a)
    got = engine.generate(prompts, max_new_tokens=8)
    for g, p, r in zip(got, plain, ref):
        assert g.token_ids == p.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-2, rtol=0)
    assert len(methods) >= 7
    if kind == "v32":
        assert set(methods) == {ForwardMethod.ABSORBED, ForwardMethod.SPARSE}


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpu_every_bucket_captured_once_without_syncs(hf_checkpoint, compile):
    """The whole constructor (warm-up and capture of every bucket) under sync debug mode "error".
    Compiled: Inductor's one-time lazy setup (its attention pattern tracing) syncs, so a first
    compiled engine runs before, outside the check; the engine's own compile and capture do not."""
    _, path = hf_checkpoint("v32")
    model = DeepseekForCausalLM.from_pretrained(path, backend="triton", device="cuda", progress=False)
    if compile:
        Engine(model, max_num_seqs=2, max_model_len=128, page_size=16, compile=True).generate([[1, 2]], max_new_tokens=2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine = Engine(model, max_num_seqs=8, max_model_len=128, page_size=16, compile=compile, cuda_graphs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    buckets = [1, 2, 4, 8]  # compiled too: a lone request runs unpadded, in bucket 1
    assert engine.graphs.buckets == buckets
    assert set(engine.graphs.graphs) == {(b, m) for b in buckets for m in (ForwardMethod.ABSORBED, ForwardMethod.SPARSE)}
    captured = dict(engine.graphs.graphs)
    engine.generate(_prompts(9, [5, 20, 7]), max_new_tokens=4)
    assert engine.graphs.graphs == captured  # nothing captured again


@pytest.mark.gpu
def test_gpu_reduce_overhead_mode(hf_checkpoint):
    """Inductor's CUDA-graph trees record the static buckets instead of our capture."""
    _, path = hf_checkpoint("v3")
    prompts = _prompts(10, [4, 11, 6])
    want = _gpu_engine(path, compile=True).generate(prompts, max_new_tokens=6)
    engine = _gpu_engine(path, compile=True, cuda_graphs=True, compile_options={"mode": "reduce-overhead"})
    assert isinstance(engine.graphs, graphs.InductorDecodeGraphs)
    got = engine.generate(prompts, max_new_tokens=6)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_prompt_logprobs_with_graphs(hf_checkpoint):
    _, path = hf_checkpoint("v3")
    prompts = _prompts(11, [9, 30])
    want = _gpu_engine(path).prompt_logprobs(prompts, chunk_size=8)
    got = _gpu_engine(path, cuda_graphs=True).prompt_logprobs(prompts, chunk_size=8)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_gpu_bf16_graphs_generate_like_no_graphs(backend):
    """bf16, on the aiter backend too (its decode needs a bf16 cache, and block dims >= 16, hence
    the wider config): graphs change nothing."""
    from tests.model.test_aiter_backend import _wide

    prompts = _prompts(12, [6, 13])
    model = DeepseekForCausalLM.from_config(_wide("v3"), backend=backend, device="cuda", dtype=torch.bfloat16,
                                            init_std=0.2)
    want = Engine(model, max_num_seqs=4, max_model_len=128, page_size=16, compile=True).generate(
        prompts, max_new_tokens=6)
    got = Engine(model, max_num_seqs=4, max_model_len=128, page_size=16, compile=True, cuda_graphs=True).generate(
        prompts, max_new_tokens=6)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, backend
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=5e-2, rtol=0)
