"""The model on the aiter backend equals the model on the reference backend.

On CPU aiter's kernels (and the triton kernels it falls back to) run through Triton's
interpreter on the tiny float32 checkpoints of conftest.py (kv_lora 32, rope 8, 4 heads: aiter's
kernels take these dims in the interpreter); under ``pytest -m gpu`` the same comparison runs on
the H200. Eager steps run aiter's decode; compiled steps also run aiter's fused RoPE + cache op
(the fusion pass puts it in), so both are compared.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import mlagraph
from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.ops import aiter as aiter_backend

from .conftest import VOCAB, hf_config

AITER_OK, AITER_WHY = aiter_backend.available()
pytestmark = [
    pytest.mark.skipif(not AITER_OK, reason=AITER_WHY),
    pytest.mark.filterwarnings("ignore:invalid value encountered"),  # aiter decode's 0/0 on padding requests
]
TOL = 1e-4


@pytest.fixture
def interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of Triton kernels need TRITON_INTERPRET=1 (set by tests/conftest.py)")


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path, backend: str, device: str = "cpu", **kw) -> Engine:
    model = DeepseekForCausalLM.from_pretrained(path, backend=backend, device=device, progress=False)
    return Engine(model, max_num_seqs=4, max_model_len=128, page_size=kw.pop("page_size", 4), **kw)


@pytest.mark.parametrize("kind", ["v2", "v3", "v32"])
def test_prompt_logprobs_equal_reference_backend(interpreter, hf_checkpoint, kind):
    """Chunked prefill (MHA over the cached prefix) and plain prefill."""
    _, path = hf_checkpoint(kind)
    prompts = _prompts(1, [9, 20])  # V3.2: 20 > index_topk=12, so the indexer's top-k matters
    want = _engine(path, "reference").prompt_logprobs(prompts, chunk_size=6)
    got = _engine(path, "aiter").prompt_logprobs(prompts, chunk_size=6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["v2", "v3", "v32"])
def test_greedy_generation_equals_reference_backend(interpreter, hf_checkpoint, kind):
    """Decode steps run aiter's decode (V3.2: the requests that fit index_topk run the dense
    variants; the long one sparse MLA, triton's)."""
    _, path = hf_checkpoint(kind)
    prompts = _prompts(2, [5, 14, 3])
    want = _engine(path, "reference").generate(prompts, max_new_tokens=6, temperature=0.0)
    got = _engine(path, "aiter").generate(prompts, max_new_tokens=6, temperature=0.0)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=TOL, rtol=0)


def test_compiled_engine_equals_reference_backend(interpreter, hf_checkpoint):
    """Compiled (passes on: aiter's fused op in chunked-prefill and decode graphs), prompt
    logprobs and greedy generation equal the reference backend's eager engine."""
    _, path = hf_checkpoint("v3")
    prompts = _prompts(3, [9, 17])
    ref = _engine(path, "reference")
    compiled = _engine(path, "aiter", compile=True, compile_backend="mlagraph_eager")
    for g, w in zip(compiled.prompt_logprobs(prompts, chunk_size=7), ref.prompt_logprobs(prompts, chunk_size=7)):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)
    for g, w in zip(compiled.generate(prompts, max_new_tokens=4), ref.generate(prompts, max_new_tokens=4)):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=TOL, rtol=0)
    fused = [r for r in mlagraph.passes.reports() if r.graph.startswith("aiter#") and r.pass_name ==
             "fuse_rope_concat_cache"]
    assert fused, "aiter's fused op was never put in a compiled graph"


def test_quantized_cache_is_refused(hf_checkpoint):
    """aiter's decode reads unquantized caches only: the table says so, and the model refuses
    fp8 caches up front rather than failing in the first decode step."""
    _, path = hf_checkpoint("v3")
    for dtype in ("fp8", "fp8_ds"):
        with pytest.raises(ValueError, match=r"backend 'aiter' supports cache layouts \['bf16'\]"):
            DeepseekForCausalLM.from_pretrained(path, backend="aiter", kv_cache_dtype=dtype, progress=False)


def _wide(kind: str) -> dict:
    """conftest's tiny config with DeepSeek-like proportions aiter's kernels take on the GPU:
    tl.dot needs every block dim >= 16 there, and the tiny checkpoints have rope dim 8."""
    cfg = hf_config(kind).to_dict()
    cfg.update(kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, hidden_size=128,
               num_attention_heads=16, num_key_value_heads=16)
    return cfg


def _wide_engines(kind: str, device: str, page_size: int) -> list[Engine]:
    return [Engine(DeepseekForCausalLM.from_config(_wide(kind), backend=b, device=device, init_std=0.2),
                   max_num_seqs=4, max_model_len=128, page_size=page_size) for b in ("reference", "aiter")]


def _compare(engines, prompts, chunk, atol):
    """Prompt logprobs, and greedy decode up to the first token the two backends disagree on
    (a near-tie may flip under tf32 dots); at least the first token must agree."""
    (ref, ait) = engines
    for g, w in zip(ait.prompt_logprobs(prompts, chunk_size=chunk), ref.prompt_logprobs(prompts, chunk_size=chunk)):
        torch.testing.assert_close(g.cpu(), w.cpu(), atol=atol, rtol=0)
    for g, w in zip(ait.generate(prompts, max_new_tokens=4), ref.generate(prompts, max_new_tokens=4)):
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
        assert n >= 1
        torch.testing.assert_close(torch.tensor(g.logprobs[:n]), torch.tensor(w.logprobs[:n]), atol=atol, rtol=0)


def test_wide_config_equals_reference_backend(interpreter):
    """The GPU test's config (L 128, R 16, 16 heads) on CPU, through the interpreter."""
    _compare(_wide_engines("v3", "cpu", 4), _prompts(4, [7, 12]), 5, TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_logprobs_equal_reference_backend(kind, page_size):
    """On the H200: aiter's compiled kernels vs the reference ops, same float32 weights (float32
    dots may run in tf32, hence the looser tolerance)."""
    _compare(_wide_engines(kind, "cuda", page_size), _prompts(3, [9, 40]), 16, 1e-2)
