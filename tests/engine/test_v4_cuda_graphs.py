"""Graph-captured decode for DeepSeek-V4 (Engine(cuda_graphs=True)).

On CPU: the engine's graph path with the capture replaced by a direct call of the model on the
static batch (tests/engine/test_cuda_graphs.py's _DirectGraphs) against the plain engine, with
requests that cross the CSA dense limit while decoding (both graph variants replay), and the
caches the graphs must treat as static (every V4 cache tensor). On the H200
(tests/model/test_v4_triton_backend.py and below): real captures, eager, compiled and
Inductor's reduce-overhead mode.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.engine import cuda_graphs as graphs
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.batch import ForwardMethod
from tests.engine.test_cuda_graphs import _DirectGraphs
from tests.model.test_oracle_v4 import VOCAB, v4_config

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _model(backend="reference", device="cpu") -> DeepseekForCausalLM:
    cfg = v4_config(num_hidden_layers=3, layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe"]).to_dict()
    return DeepseekForCausalLM.from_config(cfg, backend=backend, device=device, init_std=0.2)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def test_cache_tensors_are_every_v4_cache():
    model = _model()
    caches = model.allocate_caches(8, 4)
    got = graphs.cache_tensors(caches)
    # sliding: window; CSA: window, state, compressed, index state, index keys; HCA: three
    assert len(got) == 1 + 5 + 3
    assert {id(t) for t in got} == {id(t) for c in caches for t in vars(c).values() if t is not None}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_graph_path_equals_plain_engine_cpu(backend):
    """The CSA dense limit is index_topk·m + m - 1 = 7 tokens: the short prompts start dense and
    turn sparse while decoding, so both captured variants replay; padding rows of the bucket
    (no pages) write nothing any real request reads."""
    model = _model(backend)
    assert model.config.dsa_dense_max_kv_len == 7
    prompts = _prompts(4, [3, 2, 4, 1, 2])  # all dense at first; the fifth waits, then decodes alone
    kw = dict(max_num_seqs=4, max_model_len=48, page_size=4)
    want = Engine(model, **kw).generate(prompts, max_new_tokens=6)
    engine = Engine(model, **kw)
    plans = graphs.decode_plans(model.backend.capabilities, model.config.uses_dsa)
    engine.runner.graphs = _DirectGraphs(model, engine.caches, [1, 2, 4], plans, 12, "cpu", progress=False)
    got = engine.generate(prompts, max_new_tokens=6)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    used = set(engine.graphs.replays)
    assert {b for b, _ in used} == {1, 4}
    assert {m for _, m in used} == {ForwardMethod.ABSORBED, ForwardMethod.SPARSE}


@pytest.mark.gpu
def test_gpu_reduce_overhead_mode():
    """Inductor's CUDA-graph trees over the static buckets: every V4 cache marked static."""
    model = _model("triton", "cuda")
    prompts = _prompts(5, [4, 11, 6])
    kw = dict(max_num_seqs=4, max_model_len=128, page_size=16, compile=True)
    want = Engine(model, **kw).generate(prompts, max_new_tokens=6)
    engine = Engine(model, cuda_graphs=True, compile_options={"mode": "reduce-overhead"}, **kw)
    assert isinstance(engine.graphs, graphs.InductorDecodeGraphs)
    got = engine.generate(prompts, max_new_tokens=6)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_capture_without_syncs():
    """The constructor's warm-up and capture of every bucket and variant under sync debug mode
    "error": nothing in a V4 decode step reads the device on the host."""
    model = _model("triton", "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine = Engine(model, max_num_seqs=8, max_model_len=128, page_size=16, cuda_graphs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(engine.graphs.graphs) == {(b, m) for b in [1, 2, 4, 8]
                                         for m in (ForwardMethod.ABSORBED, ForwardMethod.SPARSE)}
