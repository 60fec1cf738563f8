"""mlagraph's DeepSeek V2/V3/V3.2 against transformers' implementations (the oracle).

Checkpoints are tiny random models saved by transformers with save_pretrained and loaded by
DeepseekForCausalLM.from_pretrained; everything runs in float32 on the reference backend.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine

from .conftest import VOCAB, hf_logits, hf_token_logprobs

KINDS = ["v2", "v2_qlora", "v3", "v32"]
TOL = 1e-4


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _engine(path, **kw) -> Engine:
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    return Engine(model, max_num_seqs=4, max_model_len=128, page_size=4, **kw)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_greedy_generation_stops_at_eos_like_transformers_generate(hf_checkpoint, kind):
    """The checkpoint's eos_token_id (1, transformers' default) ends generation by default, as
    in transformers' generate; these prompts reach it within 12 tokens, at different steps."""
    hf, path = hf_checkpoint(kind)
    engine = _engine(path)
    assert engine.model.eos_token_ids == (1,)
    reasons = set()
    for ids in _prompts(2, [6, 9, 13]):
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
        got = engine.generate([ids], max_new_tokens=12)[0]
        assert got.token_ids == want
        reasons.add(got.finish_reason)
        if got.finish_reason == "stop":
            assert got.token_ids[-1] == 1 and got.stop_reason == 1 and 1 not in got.token_ids[:-1]
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_prompt_logprobs_match_transformers(hf_checkpoint, kind, chunk_size):
    hf, path = hf_checkpoint(kind)
    prompts = _prompts(1, [9, 30, 17])  # V3.2: 30 > index_topk=12, so top-k selection matters
    got = _engine(path).prompt_logprobs(prompts, chunk_size=chunk_size)
    for ids, lp in zip(prompts, got):
        want = hf_token_logprobs(hf, ids)
        assert lp.shape == (len(ids) - 1,)
        torch.testing.assert_close(lp, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_teacher_forcing(hf_checkpoint, kind):
    hf, path = hf_checkpoint(kind)
    prompts = _prompts(2, [6, 21])
    outs = _engine(path).generate(prompts, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    for ids, out in zip(prompts, outs):
        assert len(out.token_ids) == 10 and out.finish_reason == "length"
        full = ids + out.token_ids
        logits = hf_logits(hf, full)[len(ids) - 1 : -1]  # predictions of each generated token
        logp = torch.log_softmax(logits, dim=-1)
        want = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=TOL, rtol=0)
        # greedy: each generated token is the argmax of the oracle's distribution (up to exact ties)
        top = logp.max(dim=-1).values
        assert torch.all(want >= top - TOL)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_batched_requests_equal_alone(hf_checkpoint, kind):
    _, path = hf_checkpoint(kind)
    prompts = _prompts(3, [5, 19, 2, 13])
    together = _engine(path).generate(prompts, max_new_tokens=6)
    for p, t in zip(prompts, together):
        alone = _engine(path).generate([p], max_new_tokens=6)[0]
        assert alone.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(t.logprobs), atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["v3", "v32"])
def test_chunked_prefill_generation_matches(hf_checkpoint, kind):
    """Chunked prefill (mixed batches of decodes and prompt chunks) gives the same tokens."""
    _, path = hf_checkpoint(kind)
    prompts = _prompts(4, [23, 7, 16])
    plain = _engine(path).generate(prompts, max_new_tokens=5)
    chunked = _engine(path, prefill_chunk_size=6).generate(prompts, max_new_tokens=5)
    for a, b in zip(plain, chunked):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)


def test_v32_long_prompt_sparse_selection_matters(hf_checkpoint):
    """Beyond index_topk the indexer's choice changes the answer: dense attention over every key
    does NOT match the oracle, while mlagraph's sparse path does."""
    hf, path = hf_checkpoint("v32")
    ids = _prompts(5, [60])[0]
    got = _engine(path).prompt_logprobs([ids])[0]
    want = hf_token_logprobs(hf, ids)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    with torch.no_grad():  # the same model with top-k larger than any prompt = dense attention
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = 10_000
        dense = hf_token_logprobs(hf, ids)
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = hf.config.index_topk
    assert (dense - want).abs().max() > 1e-2


def test_oracle_detects_broken_rope(hf_checkpoint):
    """The oracle tests can fail: flipping the RoPE layout moves logprobs far beyond TOL."""
    hf, path = hf_checkpoint("v3")
    ids = _prompts(6, [24])[0]
    model = DeepseekForCausalLM.from_pretrained(path, progress=False)
    for layer in model.model.layers:
        layer.self_attn.interleaved = not layer.self_attn.interleaved
    got = Engine(model, max_num_seqs=1, max_model_len=64, page_size=4).prompt_logprobs([ids])[0]
    assert (got - hf_token_logprobs(hf, ids)).abs().max() > 100 * TOL
