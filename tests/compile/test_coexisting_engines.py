"""Compiled engines coexist in one process: each owns its graphs (one per region, see
mlagraph/regional.py; the attention's per batch-plan variant).

Dynamo keeps its cache and its recompile limit (8) per code object. Before each compiled step
had a code object of its own, every model instance shared ``DeepseekForCausalLM.forward``'s,
so the ninth graph in the process (say, the third engine's decode) failed with
``FailOnRecompileLimitHit`` under ``fullgraph=True``. Nothing here resets dynamo or raises a
limit: the process accumulates every engine's graphs, as a user's would.
"""

from __future__ import annotations

import os
import random

import pytest

from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.ops import aiter as aiter_backend

from tests.model.conftest import VOCAB, hf_config

AITER_OK, _ = aiter_backend.available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _config(kind: str, **dims) -> dict:
    cfg = hf_config(kind).to_dict()
    cfg.update(dims)
    return cfg


# (name, config kind, dims changed, backend, page size); the triton / aiter engines run their
# kernels through Triton's interpreter on CPU
ENGINES = [
    ("v2-reference", "v2", {}, "reference", 4),
    ("v3-reference", "v3", {}, "reference", 16),
    ("v32-reference", "v32", {}, "reference", 4),
    ("v2_qlora-narrow", "v2_qlora", {"hidden_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2},
     "reference", 2),
    ("v3-wide", "v3", {"hidden_size": 96, "kv_lora_rank": 48}, "reference", 8),
    ("v3-triton", "v3", {}, "triton", 4),
    ("v32-triton", "v32", {}, "triton", 1),
    ("v3-aiter", "v3", {}, "aiter", 4),
    ("v32-single-layer", "v32", {"num_hidden_layers": 1, "first_k_dense_replace": 1}, "reference", 4),
]


# aiter's kernels need block dims >= 16 on a GPU: DeepSeek-like proportions there, as in
# tests/model/test_aiter_backend.py (on CPU the interpreter takes the tiny dims, much faster)
AITER_GPU_DIMS = {"kv_lora_rank": 128, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
                  "hidden_size": 128, "num_attention_heads": 16, "num_key_value_heads": 16}


def _prompts(seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    # lengths on both sides of the V3.2 index_topk (12): dense and sparse DSA plans
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 9)]


@pytest.mark.skipif(not AITER_OK, reason="amd-aiter is not installed (pip install mlagraph[aiter])")
@pytest.mark.parametrize("device, compile_backend", [
    pytest.param("cpu", "mlagraph_eager", marks=pytest.mark.skipif(
        not INTERPRETED, reason="the triton / aiter engines run through Triton's CPU interpreter")),
    pytest.param("cuda", "mlagraph", marks=pytest.mark.gpu),  # Inductor, compiled kernels
])
def test_many_compiled_engines_in_one_process(device, compile_backend):
    """Nine compiled engines (V2 / V3 / V3.2; reference, triton and aiter; different dims and
    page sizes) generate one after the other, then the first generates again: every engine
    compiles exactly one graph per plan variant it runs, and the first one nothing more."""
    engines, first_tokens = [], None
    for i, (name, kind, dims, backend, page_size) in enumerate(ENGINES):
        if backend == "aiter" and device == "cuda":
            dims = AITER_GPU_DIMS
        model = DeepseekForCausalLM.from_config(_config(kind, **dims), backend=backend, init_std=0.2, seed=i,
                                                device=device)
        engine = Engine(model, max_num_seqs=4, max_model_len=64, page_size=page_size, compile=True,
                        compile_backend=compile_backend)
        outs = engine.generate(_prompts(i), max_new_tokens=3, ignore_eos=True)
        assert all(len(o.token_ids) == 3 for o in outs), name
        (step,) = engine.runner.compiled
        # regions: embed, head, each MLP kind (one in a one-layer model), the attention of each
        # variant (prefill + decode at least; V3.2 dense and sparse); never a second graph of one
        assert len(step.graphs) >= 5, (name, step.graphs)
        assert set(step.graphs.values()) == {1}, (name, step.graphs)
        assert engine.compiled_graphs == len(step.graphs)
        if i == 0:
            first_tokens = [o.token_ids for o in outs]
        engines.append(engine)
    assert sum(e.compiled_graphs for e in engines) > 8  # more than one code object's limit
    first = engines[0]
    before = dict(first.runner.compiled[0].graphs)
    again = first.generate(_prompts(0), max_new_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in again] == first_tokens
    assert first.runner.compiled[0].graphs == before
    v32 = next(e for e, spec in zip(engines, ENGINES) if spec[0] == "v32-reference")
    # its prompts straddle index_topk: prefill and decode both ran the DSA split method
    kinds = {(variant[0].kind.value, variant[1].value) for variant in v32.runner.compiled[0].variants}
    assert kinds == {("prefill", "dsa_split"), ("decode", "dsa_split")}, kinds


def test_two_compiles_of_one_model_share_nothing():
    """Compiling the same model twice gives two steps with their own graphs: each compiles
    its variants once, whichever ran first."""
    import mlagraph
    from mlagraph.model.batch import build_batch

    model = DeepseekForCausalLM.from_config(hf_config("v3"), init_std=0.2)
    caps = model.backend.capabilities
    caches = model.allocate_caches(16, 4)
    a = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True)
    b = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True)
    prefill = build_batch(caps, [[1, 2, 3], [4, 5]], [0, 0], [[0], [1]], 4)
    decode = build_batch(caps, [[6], [7]], [3, 2], [[0], [1]], 4, is_decode=[True, True])
    for step in (a, b):
        for batch in (prefill, decode):
            step(batch, caches)
    assert a.variants == b.variants == {prefill.variant, decode.variant}
    # embed, head, the dense MLP, the MoE, and the attention of each variant
    assert a.graphs == b.graphs and set(a.graphs.values()) == {1}
    assert a.num_graphs == b.num_graphs == 6
