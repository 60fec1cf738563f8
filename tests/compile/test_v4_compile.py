"""DeepSeek-V4 under torch.compile: fullgraph with dynamic sizes, equal to eager."""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine
from tests.model.test_oracle_v4 import VOCAB, v4_config


@pytest.mark.slow
def test_compiled_v4_engine_matches_eager():
    """Every layer type, through the mlagraph_eager backend (the same passes on the AOT graph):
    generation with chunked prefill (prompt chunks, mixed chunk + decode steps, decode steps)
    gives the eager engine's tokens and logprobs. (Inductor itself was checked by hand:
    equal within 3e-6, two minutes to compile on two CPU cores.)"""
    cfg = v4_config(num_hidden_layers=3, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                      "heavily_compressed_attention"],
                    mlp_layer_types=["hash_moe", "moe", "moe"]).to_dict()
    model = DeepseekForCausalLM.from_config(cfg, init_std=0.2)
    kw = dict(max_num_seqs=3, max_model_len=64, page_size=4)
    compiled = Engine(model, compile=True, compile_backend="mlagraph_eager", prefill_chunk_size=7, **kw)
    eager = Engine(model, prefill_chunk_size=7, **kw)
    rnd = random.Random(0)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (11, 23, 4)]
    for a, b in zip(compiled.generate(prompts, max_new_tokens=4), eager.generate(prompts, max_new_tokens=4)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
