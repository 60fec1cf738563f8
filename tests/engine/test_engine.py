"""Engine behaviour: input validation that changes nothing, page accounting, sampling, stopping,
queueing beyond max_num_seqs, one-token prompts.

Models are random tiny DeepSeeks from conftest's configs (float32, reference backend).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM, Engine

from tests.model.conftest import VOCAB, hf_config

MAX_LEN = 48


@pytest.fixture(scope="module")
def v3():
    return DeepseekForCausalLM.from_config(hf_config("v3"))


@pytest.fixture(scope="module")
def v32_fp8():
    """V3.2 with an fp8 cache: latent fp8 rows + per-tensor scale + uint8 indexer rows."""
    return DeepseekForCausalLM.from_config(hf_config("v32"), kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def v32_fp8_fresh_answer(v32_fp8):
    """What a fresh engine generates for one probe prompt."""
    return _engine(v32_fp8).generate(_prompts(1, [6]), max_new_tokens=3)[0].token_ids


def _engine(model, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("page_size", 4)
    return Engine(model, **kw)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _cache_bytes(engine: Engine) -> list[torch.Tensor]:
    """Every cache tensor, reinterpreted as raw bytes (so fp8 and NaNs compare bit for bit)."""
    c = engine.caches
    tensors = list(c.latent) + list(c.index or []) + ([c.scale] if c.scale is not None else [])
    return [t.detach().contiguous().view(torch.uint8).clone() for t in tensors]


# --- compiled engines ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["v3", "v4"])
def test_compiled_engine_runs_one_request_unpadded(kind, v3, monkeypatch):
    """A compiled engine runs a lone request as one request: no padding request (at batch 1 it
    would run the whole model on a second row, and route that row through other experts).
    Batch sizes 1 and 2 share each variant's graph, and the tokens equal an eager engine's.
    (Under Inductor too: tests/compile/test_regional.py.)"""
    import mlagraph.engine.model_runner as model_runner
    from tests.model.test_oracle_v4 import v4_config

    model = v3 if kind == "v3" else DeepseekForCausalLM.from_config(v4_config(num_hidden_layers=2).to_dict(),
                                                                    init_std=0.2)

    sizes, build = [], model_runner.build_batch

    def spy(*args, **kw):
        batch = build(*args, **kw)
        sizes.append((batch.seq_lens.shape[0], batch.input_ids.shape[0]))
        return batch

    monkeypatch.setattr(model_runner, "build_batch", spy)
    prompt = _prompts(3, [5])
    engine = _engine(model, compile=True, compile_backend="mlagraph_eager", progress=False)
    got = engine.generate(prompt, max_new_tokens=3)[0].token_ids
    assert sizes == [(1, 5), (1, 1), (1, 1)]  # (requests, token rows): the prefill, two decode steps
    before = dict(engine.runner.step_fn.graphs)
    engine.generate(_prompts(4, [3, 6]), max_new_tokens=3)
    after = engine.runner.step_fn.graphs
    assert all(n == 1 for n in after.values())  # batch sizes 1 and 2 share each variant's graph
    if kind == "v3":  # and two requests need no other variant (V4's two may plan a DSA split)
        assert after == before
    monkeypatch.setattr(model_runner, "build_batch", build)
    assert got == _engine(model).generate(prompt, max_new_tokens=3)[0].token_ids


# --- bad input ---------------------------------------------------------------------------------

GOOD = [1, 2, 3]
BAD_CALLS = [
    # (method, args, kwargs, message regex)
    ("generate", ([],), {}, r"prompts: expected a non-empty list"),
    ("generate", ("1 2 3",), {}, r"prompts: expected a non-empty list"),
    ("generate", ([GOOD, []],), {}, r"prompts\[1\]: expected at least one token"),
    ("generate", ([GOOD, 7],), {}, r"prompts\[1\]: expected a list of token ids, got int"),
    ("generate", ([GOOD, [5] * (MAX_LEN + 1)],), {}, rf"prompts\[1\]: length {MAX_LEN + 1} exceeds max_model_len={MAX_LEN}"),
    ("generate", ([[5] * MAX_LEN],), {}, rf"prompts\[0\]: length {MAX_LEN} leaves no room .* max_model_len={MAX_LEN}"),
    ("generate", ([GOOD, [4, -1]],), {}, r"prompts\[1\]\[1\]: token id -1 is outside the vocabulary \[0, 96\)"),
    ("generate", ([[0, 1, VOCAB]],), {}, rf"prompts\[0\]\[2\]: token id {VOCAB} is outside"),
    ("generate", ([[0, 2.0]],), {}, r"prompts\[0\]\[1\]: token id 2.0 "),
    ("generate", ([[0, "3"]],), {}, r"prompts\[0\]\[1\]: token id '3' "),
    ("generate", ([[True]],), {}, r"prompts\[0\]\[0\]: token id True "),
    ("generate", ([GOOD],), {"max_new_tokens": 0}, r"max_new_tokens: expected a positive int, got 0"),
    ("generate", ([GOOD],), {"max_new_tokens": 2.0}, r"max_new_tokens: expected a positive int, got 2.0"),
    ("generate", ([GOOD],), {"temperature": -0.5}, r"temperature: expected a finite number >= 0, got -0.5"),
    ("generate", ([GOOD],), {"temperature": math.nan}, r"temperature: .* got nan"),
    ("generate", ([GOOD],), {"temperature": math.inf}, r"temperature: .* got inf"),
    ("generate", ([GOOD],), {"temperature": "0.7"}, r"temperature: .* got '0.7'"),
    ("prompt_logprobs", ([],), {}, r"prompts: expected a non-empty list"),
    ("prompt_logprobs", ([GOOD, []],), {}, r"prompts\[1\]: expected at least one token"),
    ("prompt_logprobs", ([[5] * (MAX_LEN + 1)],), {}, rf"prompts\[0\]: length {MAX_LEN + 1} exceeds"),
    ("prompt_logprobs", ([GOOD, [3, 200]],), {}, r"prompts\[1\]\[1\]: token id 200 is outside"),
    ("prompt_logprobs", ([GOOD],), {"chunk_size": 0}, r"chunk_size: expected a positive int or None, got 0"),
    ("prompt_logprobs", ([GOOD],), {"chunk_size": 2.5}, r"chunk_size: expected a positive int or None, got 2.5"),
]


@pytest.mark.parametrize("method, args, kwargs, match", BAD_CALLS, ids=[f"{m}-{x}" for m, _, _, x in BAD_CALLS])
def test_bad_input_is_rejected_and_changes_nothing(v32_fp8, v32_fp8_fresh_answer, method, args, kwargs, match):
    engine = _engine(v32_fp8)
    engine.generate(_prompts(0, [9, 14]), max_new_tokens=2)  # caches hold real data now
    before, free, rng = _cache_bytes(engine), engine.allocator.num_free, engine.generator.get_state()
    assert any(b.any() for b in before) and free == engine.num_pages
    with pytest.raises(ValueError, match=match):
        getattr(engine, method)(*args, **kwargs)
    after = _cache_bytes(engine)
    assert len(after) == 2 * 2 + 1  # latent + indexer per layer, and the fp8 scale
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    assert engine.allocator.num_free == free
    assert torch.equal(engine.generator.get_state(), rng)
    # and the engine still works, with the same answer as a fresh one
    assert engine.generate(_prompts(1, [6]), max_new_tokens=3)[0].token_ids == v32_fp8_fresh_answer


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_seqs": 0}, r"max_num_seqs: expected a positive int, got 0"),
        ({"max_num_seqs": 2.0}, r"max_num_seqs: expected a positive int, got 2.0"),
        ({"max_model_len": -1}, r"max_model_len: expected a positive int, got -1"),
        ({"max_model_len": 257}, r"max_model_len: expected <= max_position_embeddings \(256\), got 257"),
        ({"page_size": 0}, r"page_size: expected a positive int, got 0"),
        ({"page_size": "16"}, r"page_size: expected a positive int, got '16'"),
        ({"prefill_chunk_size": 0}, r"prefill_chunk_size: expected a positive int or None, got 0"),
        ({"prefill_chunk_size": 1.5}, r"prefill_chunk_size: expected a positive int or None, got 1.5"),
        ({"num_pages": 0}, r"num_pages: expected a positive int or None, got 0"),
        ({"num_pages": 3.0}, r"num_pages: expected a positive int or None, got 3.0"),
        ({"cuda_graphs": True}, r"cuda_graphs=True needs a model on a CUDA device, got cpu"),
    ],
)
def test_bad_engine_args(v3, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(v3, **{"max_model_len": MAX_LEN, **kwargs})


# --- pages ---------------------------------------------------------------------------------------


def test_all_pages_return_after_generate_and_prompt_logprobs(v3):
    engine = _engine(v3, max_num_seqs=2, prefill_chunk_size=5)
    assert engine.num_pages == 2 * math.ceil(MAX_LEN / 4)
    prompts = _prompts(2, [13, 1, 30, 7, 22])
    outs = engine.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert engine.allocator.num_free == engine.num_pages
    engine.prompt_logprobs(prompts, chunk_size=4)
    assert engine.allocator.num_free == engine.num_pages
    # the free list is whole: every page exactly once
    assert sorted(engine.allocator.allocate(engine.num_pages)) == list(range(engine.num_pages))


def test_too_few_pages_is_an_error_at_construction(v3):
    with pytest.raises(ValueError, match=r"Engine: num_pages: expected at least 12 \(one request of max_model_len=48 "
                                         r"tokens in pages of 4\), got 5"):
        _engine(v3, max_num_seqs=2, num_pages=5)


def test_few_pages_queue_requests_instead_of_failing(v3):
    """Requests wait for pages instead of running out of them mid-generation."""
    prompts = _prompts(3, [9, 9, 20])
    want = _engine(v3).generate(prompts, max_new_tokens=10, ignore_eos=True)
    engine = _engine(v3, max_num_seqs=3, num_pages=12)  # one full-length request's pages
    got = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.allocator.num_free == 12


def test_pages_return_when_a_step_fails(v3):
    """The model fails mid-generation: the error surfaces, no page leaks, the engine still works."""
    engine = _engine(v3, max_num_seqs=2)
    calls = []

    def failing(batch, caches):
        calls.append(batch.num_reqs)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return v3(batch, caches)

    engine.runner.step_fn = failing
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(_prompts(3, [9, 9]), max_new_tokens=10)
    assert engine.allocator.num_free == engine.num_pages and not engine.has_unfinished_requests()
    engine.runner.step_fn = v3
    assert len(engine.generate(_prompts(3, [9]), max_new_tokens=4, ignore_eos=True)[0].token_ids) == 4
    assert engine.allocator.num_free == engine.num_pages


# --- sampling --------------------------------------------------------------------------------------


def test_temperature_sampling(v3):
    prompts = _prompts(4, [5, 11])
    kw = dict(max_new_tokens=12, temperature=1.7)
    a = _engine(v3, seed=7).generate(prompts, **kw)
    b = _engine(v3, seed=7).generate(prompts, **kw)
    c = _engine(v3, seed=8).generate(prompts, **kw)
    greedy = _engine(v3).generate(prompts, max_new_tokens=12)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    # logprobs are of the unscaled (temperature 1) distribution: teacher forcing agrees
    scorer = _engine(v3)
    for p, o in zip(prompts + prompts, a + c):
        full = p + o.token_ids
        want = scorer.prompt_logprobs([full])[0][len(p) - 1 :]
        torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=0)
    # a tiny temperature is greedy
    cold = _engine(v3, seed=3).generate(prompts, max_new_tokens=12, temperature=1e-4)
    assert [o.token_ids for o in cold] == [o.token_ids for o in greedy]


def test_greedy_is_the_argmax_of_teacher_forcing(v3):
    prompt = _prompts(5, [10])[0]
    out = _engine(v3).generate([prompt], max_new_tokens=8)[0]
    full = prompt + out.token_ids
    lp = _engine(v3).prompt_logprobs([full])[0][len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor(out.logprobs), lp, atol=1e-4, rtol=0)
    assert all(x <= 0 for x in out.logprobs) and math.exp(max(out.logprobs)) > 1 / VOCAB


# --- stopping ----------------------------------------------------------------------------------------


def test_stop_token_ids(v3):
    prompts = _prompts(6, [4, 9, 15])
    plain = _engine(v3).generate(prompts, max_new_tokens=10, ignore_eos=True)
    # a token the first request generates at step 3, not before
    toks = plain[0].token_ids
    k = next(i for i in range(2, 10) if toks[i] not in toks[:i])
    stop = toks[k]
    outs = _engine(v3).generate(prompts, max_new_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    for p, o in zip(plain, outs):
        if stop in p.token_ids:
            j = p.token_ids.index(stop)
            assert o.token_ids == p.token_ids[: j + 1] and o.finish_reason == "stop"
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(p.logprobs[: j + 1]), atol=1e-5, rtol=0)
        else:
            assert o.token_ids == p.token_ids and o.finish_reason == "length"
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) == k + 1
    # stopping on the very first token
    first = _engine(v3).generate(prompts[:1], max_new_tokens=10, stop_token_ids=[toks[0], 95], ignore_eos=True)[0]
    assert first.token_ids == toks[:1] and first.finish_reason == "stop" and first.stop_reason == toks[0]


def test_max_model_len_stops_requests(v3):
    prompts = _prompts(7, [12, 15, 3])
    free = _engine(v3).generate(prompts, max_new_tokens=10)
    short = _engine(v3, max_model_len=16).generate(prompts, max_new_tokens=10)
    assert [len(o.token_ids) for o in short] == [4, 1, 10]
    assert [o.finish_reason for o in short] == ["max_model_len", "max_model_len", "length"]
    for f, s, p in zip(free, short, prompts):
        assert s.token_ids == f.token_ids[: len(s.token_ids)] and s.prompt_len == len(p)
        assert len(p) + len(s.token_ids) <= 16
    # max_new_tokens reached at max_model_len exactly: "length" wins
    exact = _engine(v3, max_model_len=16).generate([prompts[0]], max_new_tokens=4)[0]
    assert exact.token_ids == free[0].token_ids[:4] and exact.finish_reason == "length"


# --- queueing ------------------------------------------------------------------------------------------


def test_more_requests_than_max_num_seqs(v3):
    prompts = _prompts(8, [5, 17, 2, 11, 8, 23, 1])
    engine = _engine(v3, max_num_seqs=2)
    sizes = []

    def step(batch, caches):
        sizes.append(batch.num_reqs)
        return v3(batch, caches)

    engine.runner.step_fn = step
    together = engine.generate(prompts, max_new_tokens=5, ignore_eos=True)
    assert max(sizes) == 2 and len(sizes) >= math.ceil(len(prompts) / 2) * 5
    assert engine.allocator.num_free == engine.num_pages
    for p, t in zip(prompts, together):
        alone = _engine(v3, max_num_seqs=1).generate([p], max_new_tokens=5, ignore_eos=True)[0]
        assert t.token_ids == alone.token_ids and t.finish_reason == "length" and t.prompt_len == len(p)
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    # prompt_logprobs beyond max_num_seqs too
    got = engine.prompt_logprobs(prompts)
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, _engine(v3).prompt_logprobs([p])[0], atol=1e-5, rtol=0)


# --- one-token prompts -------------------------------------------------------------------------------


def test_one_token_prompt(v3):
    engine = _engine(v3)
    out = engine.generate([[7]], max_new_tokens=4)[0]
    assert len(out.token_ids) == 4 and out.prompt_len == 1
    want = engine.prompt_logprobs([[7] + out.token_ids])[0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)
    lps = engine.prompt_logprobs([[7], [3, 9, 1], [0]])
    assert lps[0].shape == (0,) and lps[0].dtype == torch.float32
    assert lps[2].shape == (0,) and lps[1].shape == (2,)
    torch.testing.assert_close(lps[1], engine.prompt_logprobs([[3, 9, 1]])[0], atol=1e-5, rtol=0)
    assert engine.allocator.num_free == engine.num_pages
