"""DeepSeek-V4 on the triton backend equals it on the reference backend (every layer type).

Decode steps run the triton decode kernels (interpreted on CPU), compiled steps the V4 front's
RoPE + window-write fusion into triton's fused kernel; prefill stays on the reference ops (the
declared fallbacks). On the H200 the same checks run with compiled kernels, eager, compiled
and with CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine
from tests.model.test_oracle_v4 import VOCAB, v4_config

TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _model(backend: str, device: str = "cpu", dtype=torch.float32) -> DeepseekForCausalLM:
    cfg = v4_config(num_hidden_layers=3, layer_types=TYPES, mlp_layer_types=["hash_moe", "moe", "moe"]).to_dict()
    return DeepseekForCausalLM.from_config(cfg, backend=backend, device=device, dtype=dtype, init_std=0.2)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _generate(model, prompts, n=6, **kw):
    kw = {"max_num_seqs": 3, "max_model_len": 64, "page_size": 4, **kw}
    return Engine(model, **kw).generate(prompts, max_new_tokens=n)


def _assert_same(got, want, atol):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=atol, rtol=0)


def test_generate_equals_reference_backend():
    """Prompts cross the window (6) and several compressed entries; decode runs the kernels."""
    prompts = _prompts(0, [11, 4, 17])
    _assert_same(_generate(_model("triton"), prompts), _generate(_model("reference"), prompts), 1e-4)


@pytest.mark.slow
def test_compiled_generate_equals_reference_backend():
    """Through the passes (the V4 front fused into triton's fused op) on the mlagraph_eager backend."""
    prompts = _prompts(1, [9, 14])
    got = _generate(_model("triton"), prompts, compile=True, compile_backend="mlagraph_eager", prefill_chunk_size=5)
    _assert_same(got, _generate(_model("reference"), prompts, prefill_chunk_size=5), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compiled", "graphs", "compiled_graphs"])
def test_gpu_equals_reference_backend(mode):
    """float32 on the H200: eager, Inductor, CUDA graphs, both (graphs == no graphs exactly in
    tokens; logprobs within 1e-4 of the reference backend)."""
    prompts = _prompts(2, [11, 30, 5])
    kw = dict(compile="compiled" in mode, cuda_graphs="graphs" in mode, max_model_len=128, page_size=16)
    want = _generate(_model("reference", "cuda"), prompts, n=8, max_model_len=128, page_size=16)
    _assert_same(_generate(_model("triton", "cuda"), prompts, n=8, **kw), want, 1e-4)


@pytest.mark.gpu
def test_gpu_bf16_graphs_equal_no_graphs():
    prompts = _prompts(3, [40, 7])
    model = _model("triton", "cuda", torch.bfloat16)
    kw = dict(max_model_len=128, page_size=16, compile=True)
    _assert_same(_generate(model, prompts, n=8, cuda_graphs=True, **kw), _generate(model, prompts, n=8, **kw), 5e-2)
