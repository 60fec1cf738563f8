"""Text in and out (the checkpoint's tokenizer, the chat template), stop strings, streaming,
and the step API that generate() and generate_stream() are built on."""

from __future__ import annotations

import random
import shutil

import pytest

from mlagraph.engine import Engine
from mlagraph.model import DeepseekForCausalLM
from tests.model.conftest import VOCAB, hf_config
from tests.model.tiny_tokenizer import write_tokenizer

WORDS = "hello world the cat sat on the mat a dog ran".split()


@pytest.fixture(scope="module")
def model_with_tokenizer(hf_checkpoint, tmp_path_factory):
    _, path = hf_checkpoint("v3")
    ckpt = shutil.copytree(path, tmp_path_factory.mktemp("ckpt_tok") / "ckpt")
    write_tokenizer(ckpt)
    return DeepseekForCausalLM.from_pretrained(ckpt, progress=False)


@pytest.fixture(scope="module")
def bare_model():
    return DeepseekForCausalLM.from_config(hf_config("v3"))


def _engine(model, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 4)
    return Engine(model, max_model_len=64, page_size=4, **kw)


def _texts(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randrange(2, 9))) for _ in range(n)]


def test_text_prompts_give_text_outputs(model_with_tokenizer):
    tok = model_with_tokenizer.tokenizer
    texts = _texts(0, 3)
    engine = _engine(model_with_tokenizer)
    by_text = engine.generate(texts, max_new_tokens=8, ignore_eos=True)
    by_ids = engine.generate([tok.encode(t) for t in texts], max_new_tokens=8, ignore_eos=True)
    for t, a, b in zip(texts, by_text, by_ids):
        assert a.token_ids == b.token_ids and a.prompt_len == len(tok.encode(t))
        assert a.text == b.text == tok.decode(a.token_ids) and a.text  # ids prompts get text too


def test_conversation_prompts_use_the_chat_template(model_with_tokenizer):
    tok = model_with_tokenizer.tokenizer
    chat = [{"role": "user", "content": "hello the cat"}]
    engine = _engine(model_with_tokenizer)
    got = engine.generate([chat], max_new_tokens=5, ignore_eos=True)[0]
    ids = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    assert ids == [0, 3, 5, 7, 8, 4]
    assert got.prompt_len == len(ids)
    assert got.token_ids == engine.generate([ids], max_new_tokens=5, ignore_eos=True)[0].token_ids


def test_without_a_tokenizer_strings_are_refused_and_text_is_none(bare_model):
    engine = _engine(bare_model)
    with pytest.raises(ValueError, match=r"prompts\[1\]: got a string, but the model has no tokenizer"):
        engine.generate([[1, 2], "hello"])
    with pytest.raises(ValueError, match=r"generate: stop: stop strings need the model's tokenizer"):
        engine.generate([[1, 2]], stop=["x"])
    assert engine.generate([[1, 2]], max_new_tokens=2)[0].text is None
    assert engine.allocator.num_free == engine.num_pages


def test_stop_strings_cut_the_text_and_stop(model_with_tokenizer):
    engine = _engine(model_with_tokenizer)
    prompts = _texts(1, 4)
    plain = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    words = plain[0].text.split()
    stop = " ".join(words[2:4])  # two words, so the match spans two tokens
    outs = engine.generate(prompts, max_new_tokens=12, ignore_eos=True, stop=[stop, "never there"])
    for p, o in zip(plain, outs):
        if stop in p.text:
            cut = p.text.index(stop)
            assert o.text == p.text[:cut] and o.finish_reason == "stop" and o.stop_reason == stop
            assert o.token_ids == p.token_ids[: len(o.token_ids)] and len(o.token_ids) < len(p.token_ids)
            assert stop in model_with_tokenizer.tokenizer.decode(o.token_ids)  # ids keep the stop's tokens
        else:
            assert o.text == p.text and o.finish_reason == "length"
    assert outs[0].finish_reason == "stop"
    assert outs[0].describe() == f"finish_reason=stop (stop string {stop!r})"


def test_stream_equals_generate(model_with_tokenizer):
    engine = _engine(model_with_tokenizer, max_num_seqs=2)  # 3 prompts: one waits, so streams interleave late
    prompts = _texts(2, 3)
    kw = dict(max_new_tokens=10, ignore_eos=True, stop=["cat sat"])
    want = engine.generate(prompts, **kw)
    tokens, texts, ends = [[] for _ in prompts], ["" for _ in prompts], [None for _ in prompts]
    order = []
    for chunk in engine.generate_stream(prompts, **kw):
        assert ends[chunk.index] is None  # nothing after the last chunk
        tokens[chunk.index].append(chunk.token_id)
        texts[chunk.index] += chunk.text
        ends[chunk.index] = chunk.finish_reason
        order.append(chunk.index)
    for w, t, x, e in zip(want, tokens, texts, ends):
        assert (t, x, e) == (w.token_ids, w.text, w.finish_reason)
    assert order[:2] == [0, 1] and 2 in order
    assert engine.allocator.num_free == engine.num_pages


def test_stream_closed_early_releases_everything(model_with_tokenizer):
    engine = _engine(model_with_tokenizer)
    stream = engine.generate_stream(_texts(3, 3), max_new_tokens=10)
    next(stream)
    stream.close()
    assert engine.allocator.num_free == engine.num_pages and not engine.has_unfinished_requests()


def test_step_api_equals_generate(bare_model):
    engine = _engine(bare_model, max_num_seqs=2)
    rnd = random.Random(4)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (5, 11, 3)]
    want = engine.generate(prompts, max_new_tokens=6)
    ids = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    assert engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"generate: expected no requests in flight, got 3 added with add_request"):
        engine.generate(prompts)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished
            finished[out.request_id] = out
        steps += 1
    assert steps >= 7 and sorted(finished) == sorted(ids)
    for rid, w in zip(ids, want):
        assert finished[rid].token_ids == w.token_ids and finished[rid].finish_reason == w.finish_reason
    assert engine.allocator.num_free == engine.num_pages
    assert engine.step() == []


def test_add_request_checks_everything_first(bare_model):
    engine = _engine(bare_model)
    for args, kw, match in [
        (([1, 99],), {}, r"add_request: prompt\[1\]: token id 99 is outside the vocabulary \[0, 96\)"),
        (([1] * 64,), {}, r"add_request: prompt: length 64 leaves no room to generate within max_model_len=64"),
        (([1, 2],), {"max_new_tokens": 0}, r"add_request: max_new_tokens: expected a positive int, got 0"),
        (([1, 2],), {"stop_token_ids": [96]}, r"add_request: stop_token_ids\[0\]: token id 96 is outside"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args, **kw)
    assert not engine.has_unfinished_requests()


def test_engine_constructor_names_bad_arguments(bare_model):
    for kw, match in [
        ({"compile": True, "compile_options": {"bogus": 1}},
         r"compile_options: expected keys among \['mode', 'passes', 'strict', 'lint', 'options', 'regional'\], got unknown \['bogus'\]"),
        ({"prefix_caching": "yes"}, r"Engine: prefix_caching: expected a bool, got 'yes'"),
        ({"compile": True, "compile_backend": "inductor"}, r"compile_backend: expected 'mlagraph' or 'mlagraph_eager', got 'inductor'"),
        ({"progress": 1}, r"Engine: progress: expected a bool or None, got 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            _engine(bare_model, **kw)


def test_numpy_and_torch_token_ids_are_prompts(bare_model):
    import numpy as np
    import torch

    engine = _engine(bare_model)
    want = engine.generate([[5, 9, 2], [7, 1]], max_new_tokens=3)
    got = engine.generate([np.array([5, 9, 2]), [np.int64(7), torch.tensor(1)]], max_new_tokens=3)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
