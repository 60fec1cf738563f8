"""The model on the triton backend equals the model on the reference backend.

On CPU every Triton kernel runs through Triton's interpreter (tiny models); the same tests run
on the H200 with compiled kernels under ``pytest -m gpu``. Float32 throughout on CPU, so the two
backends agree to float32 rounding; transformers is the oracle behind the reference backend
(tests/model/test_oracle.py).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlagraph.model import DeepseekForCausalLM, Engine
from mlagraph.model.batch import build_batch

from .conftest import VOCAB

TOL = 1e-4


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path, backend: str, device: str = "cpu", **kw) -> Engine:
    model = DeepseekForCausalLM.from_pretrained(path, backend=backend, device=device, progress=False,
                                                kv_cache_dtype=kw.pop("kv_cache_dtype", "auto"))
    return Engine(model, max_num_seqs=4, max_model_len=128, page_size=4, **kw)


@pytest.mark.parametrize("kind", ["v2", "v3", "v32"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prompt_logprobs_equal_reference_backend(hf_checkpoint, kind, kv_cache_dtype):
    _, path = hf_checkpoint(kind)
    prompts = _prompts(1, [9, 20])  # V3.2: 20 > index_topk=12, so the indexer's top-k matters
    want = _engine(path, "reference", kv_cache_dtype=kv_cache_dtype).prompt_logprobs(prompts, chunk_size=6)
    got = _engine(path, "triton", kv_cache_dtype=kv_cache_dtype).prompt_logprobs(prompts, chunk_size=6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_greedy_generation_equals_reference_backend(hf_checkpoint, kind):
    _, path = hf_checkpoint(kind)
    prompts = _prompts(2, [5, 14])
    want = _engine(path, "reference").generate(prompts, max_new_tokens=6, temperature=0.0)
    got = _engine(path, "triton").generate(prompts, max_new_tokens=6, temperature=0.0)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_gpu_logprobs_equal_reference_backend(hf_checkpoint, kind):
    """On the H200: compiled Triton kernels vs the reference ops, same float32 weights (the
    kernels' float32 dots may run in tf32, hence the looser tolerance)."""
    _, path = hf_checkpoint(kind)
    prompts = _prompts(3, [9, 40])
    outs = []
    for backend in ("reference", "triton"):
        model = DeepseekForCausalLM.from_pretrained(path, backend=backend, device="cuda",
                                                    progress=False)
        engine = Engine(model, max_num_seqs=4, max_model_len=128, page_size=16)
        outs.append(engine.prompt_logprobs(prompts, chunk_size=16))
    for g, w in zip(outs[1], outs[0]):
        torch.testing.assert_close(g.cpu(), w.cpu(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_single_prompt_prefill_equals_reference_backend(hf_checkpoint, device):
    """One prompt, no prefix: the batch is flagged single_request, which the triton backend runs
    through cuDNN SDPA on CUDA 16-bit inputs (its own kernel otherwise, as here in float32)."""
    _, path = hf_checkpoint("v3")
    prompts = _prompts(4, [23])
    want = _engine(path, "reference", device).prompt_logprobs(prompts)
    got = _engine(path, "triton", device).prompt_logprobs(prompts)
    torch.testing.assert_close(got[0].cpu(), want[0].cpu(), atol=TOL if device == "cpu" else 1e-2, rtol=0)


class _OpCounter(TorchDispatchMode):
    """Counts the custom ops a step dispatches (namespace::name -> calls)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if "::" in name and not name.startswith(("aten::", "prim::")):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("decode", [False, True])
def test_eager_step_runs_the_backends_rope_and_cache_write(hf_checkpoint, decode):
    """An eager triton step runs mlagraph_triton's RoPE and cache write (once per layer), and
    no reference op but the declared moe fallback (docs/design.md rule 1)."""
    _, path = hf_checkpoint("v3")
    model = DeepseekForCausalLM.from_pretrained(path, backend="triton", progress=False)
    caches = model.allocate_caches(8, 4)
    caps, layers = model.backend.capabilities, model.config.num_hidden_layers
    if decode:
        batch = build_batch(caps, [[1], [2]], [3, 5], [[0], [1, 2]], 4, is_decode=[True, True])
    else:
        batch = build_batch(caps, [[1, 2, 3], [4, 5]], [0, 0], [[0], [1]], 4)
    with _OpCounter() as counter, torch.no_grad():
        model(batch, caches)
    calls = counter.calls
    assert calls["mlagraph_triton::rope"] == layers and calls["mlagraph_triton::latent_cache_write"] == layers
    attention = "mlagraph_triton::mla_decode" if decode else "mlagraph_triton::mha_prefill"
    assert calls[attention] == layers
    reference = {name for name in calls if name.startswith("mlagraph::")}
    assert reference <= {"mlagraph::moe"}, calls
