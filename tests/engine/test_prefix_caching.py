"""Engine(prefix_caching=True): shared prompt prefixes reuse cache pages (latent and, for
V3.2, indexer keys), and every result equals prefix_caching=False."""

from __future__ import annotations

import random

import pytest
import torch

from mlagraph.engine import Engine
from mlagraph.model import DeepseekForCausalLM
from tests.model.conftest import VOCAB, hf_config

PS = 4


@pytest.fixture(scope="module", params=["v3", "v32"])
def model(request):
    return DeepseekForCausalLM.from_config(hf_config(request.param))


def _engine(model, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 2)
    return Engine(model, max_model_len=64, page_size=PS, **kw)


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    """A 21-token stem (past V3.2's index_topk=12, so its sparse path runs over cached indexer
    keys) with different tails, and a prompt that is a stem prefix."""
    rnd = random.Random(seed)
    stem = [rnd.randrange(VOCAB) for _ in range(21)]
    return [stem + [rnd.randrange(VOCAB) for _ in range(n)] for n in (3, 7, 1, 12)] + [stem[:9]]


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [None, 5])
def test_greedy_generations_equal_no_caching_and_reuse_pages(model, chunk):
    prompts = _shared_prefix_prompts(0)
    plain = _engine(model, prefill_chunk_size=chunk)
    want = plain.generate(prompts, max_new_tokens=6, ignore_eos=True)
    engine = _engine(model, prefill_chunk_size=chunk, prefix_caching=True)
    got = engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    _assert_same(got, want)
    # the first two run together (nothing cached yet); the others reuse the stem's full pages,
    # the last one only up to its own last full page that leaves a token to compute
    assert [g.num_cached_prompt_tokens for g in got] == [0, 0, 20, 20, 8]
    assert engine.stats.cached_prompt_tokens == 48 and plain.stats.cached_prompt_tokens == 0
    assert engine.stats.prompt_tokens == plain.stats.prompt_tokens == sum(map(len, prompts))
    if chunk is None:  # the same steps carry prompt tokens: exactly the cached ones are not computed
        assert engine.stats.prefill_tokens == plain.stats.prefill_tokens - 48
    else:
        assert engine.stats.prefill_tokens < plain.stats.prefill_tokens
    assert engine.allocator.num_free == engine.num_pages


def test_reused_pages_are_read_not_recomputed(model):
    """Poisoning the cached pages changes the next request's output: the hit reads them."""
    prompts = _shared_prefix_prompts(1)
    engine = _engine(model, prefix_caching=True)
    first = engine.generate([prompts[0]], max_new_tokens=4, ignore_eos=True)[0]
    again = engine.generate([prompts[0]], max_new_tokens=4, ignore_eos=True)[0]
    assert again.num_cached_prompt_tokens == 20 and again.token_ids == first.token_ids
    for t in engine.caches.latent:
        t.mul_(-3.0)
    poisoned = engine.generate([prompts[0]], max_new_tokens=4, ignore_eos=True)[0]
    assert poisoned.num_cached_prompt_tokens == 20 and poisoned.logprobs != first.logprobs


def test_prompt_logprobs_equal_no_caching_and_feed_the_cache(model):
    prompts = _shared_prefix_prompts(2)
    want = _engine(model).prompt_logprobs(prompts, chunk_size=6)
    engine = _engine(model, prefix_caching=True)
    for _ in range(2):  # the second time the prefix is cached: still every position computed
        got = engine.prompt_logprobs(prompts, chunk_size=6)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    out = engine.generate([prompts[1]], max_new_tokens=3, ignore_eos=True)[0]
    assert out.num_cached_prompt_tokens == 24  # pages computed by prompt_logprobs
    _assert_same([out], _engine(model).generate([prompts[1]], max_new_tokens=3, ignore_eos=True))


def test_eviction_under_pressure_keeps_results_exact(model):
    """Few pages, many prefixes: cached pages are evicted (least recently used first) to admit
    new requests, and every output still equals prefix_caching=False."""
    rnd = random.Random(3)
    stems = [[rnd.randrange(VOCAB) for _ in range(14)] for _ in range(3)]
    prompts = [rnd.choice(stems) + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 5))] for _ in range(12)]
    want = _engine(model).generate(prompts, max_new_tokens=4, ignore_eos=True)
    engine = _engine(model, prefix_caching=True, num_pages=16)  # one full-length request's pages
    got = engine.generate(prompts, max_new_tokens=4, ignore_eos=True)
    _assert_same(got, want)
    assert engine.stats.cached_prompt_tokens > 0 and engine.allocator.num_evicted > 0
    assert engine.allocator.num_cached <= 16 and engine.allocator.num_free == 16
