"""Stop strings over token boundaries, what a stream may show, the order of finish reasons,
and SamplingParams / prompt validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlagraph.engine.request import SamplingParams, prompt_token_ids
from mlagraph.engine.stopping import TextTracker, finish_reason
from mlagraph.model.tokenizer import Tokenizer
from tests.model.tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tiny_tokenizer(), bos_token="<s>", eos_token="</s>", add_bos_token=True)


def _push_all(tracker: TextTracker, tok: Tokenizer, text: str):
    """Pushes text's tokens one by one: [(stop string matched or None, stream delta)]."""
    out = []
    for t in tok.encode(text, add_special_tokens=False):
        hit = tracker.push(t)
        out.append((hit, tracker.releasable(finished=hit is not None)))
        if hit:
            break
    return out


def test_stop_string_spanning_tokens_cuts_the_text_before_it(tok):
    tr = TextTracker(tok, stop=("cat sat",))
    steps = _push_all(tr, tok, "the cat sat on the mat")
    assert [hit for hit, _ in steps] == [None, None, "cat sat"]
    assert tr.text == "the "
    assert "".join(d for _, d in steps) == "the "  # the stream never showed "cat"


def test_stream_holds_back_only_what_a_stop_string_may_claim(tok):
    tr = TextTracker(tok, stop=("mat!", "dog"))  # longest is 4 chars: hold back 3
    deltas = []
    for t in tok.encode("hello world the cat", add_special_tokens=False):
        assert tr.push(t) is None
        deltas.append(tr.releasable(finished=False))
    assert "".join(deltas) == "hello world the "  # " cat" minus what "dog"/"mat!" may still claim
    assert tr.releasable(finished=True) == "cat"
    assert tr.text == "hello world the cat"


def test_earliest_stop_string_wins(tok):
    tr = TextTracker(tok, stop=("sat", "cat sat"))
    _push_all(tr, tok, "the cat sat")
    assert tr.text == "the "  # "cat sat" starts earlier than "sat"


def test_without_stop_strings_text_streams_at_once(tok):
    tr = TextTracker(tok)
    assert [d for _, d in _push_all(tr, tok, "a dog ran")] == ["a", " dog", " ran"]


def test_finish_reason_order():
    stop_ids = frozenset({1, 7})
    assert finish_reason(10, 3, 7, stop_ids, None, 3, 10) == ("stop", 7)  # a stop token beats length and max_model_len
    assert finish_reason(10, 3, 5, stop_ids, "x", 3, 10) == ("stop", "x")
    assert finish_reason(10, 3, 5, stop_ids, None, 3, 10) == ("length", None)
    assert finish_reason(10, 2, 5, stop_ids, None, 3, 10) == ("max_model_len", None)
    assert finish_reason(9, 2, 5, stop_ids, None, 3, 10) == (None, None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, r"gen: max_new_tokens: expected a positive int, got 0"),
        ({"max_new_tokens": True}, r"max_new_tokens: expected a positive int, got True"),
        ({"temperature": -1}, r"temperature: expected a finite number >= 0, got -1"),
        ({"stop_token_ids": 3}, r"stop_token_ids: expected a list of token ids or None, got 3"),
        ({"stop_token_ids": [1, 99]}, r"stop_token_ids\[1\]: token id 99 is outside the vocabulary \[0, 10\)"),
        ({"stop_token_ids": [1.0]}, r"stop_token_ids\[0\]: token id 1.0 is not an integer"),
        ({"stop": [""]}, r"stop: expected a string or a list of non-empty strings, got \[''\]"),
        ({"stop": 5}, r"stop: expected a string or a list of non-empty strings, got 5"),
        ({"ignore_eos": 1}, r"ignore_eos: expected a bool, got 1"),
    ],
)
def test_sampling_params_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.checked("gen", 10, **kwargs)


def test_sampling_params_normalise():
    p = SamplingParams.checked("gen", 10, stop_token_ids=[np.int64(3)], stop="x", temperature=1)
    assert p.stop_token_ids == (3,) and type(p.stop_token_ids[0]) is int and p.stop == ("x",) and p.temperature == 1.0


def test_prompt_token_ids_accepts_numpy_and_torch_integers(tok):
    assert prompt_token_ids([np.int64(3), np.int32(4), 5], "p", 10, None) == [3, 4, 5]
    assert prompt_token_ids(np.array([1, 2]), "p", 10, None) == [1, 2]
    assert prompt_token_ids(torch.tensor([1, 2]), "p", 10, None) == [1, 2]
    assert prompt_token_ids("hello cat", "p", 100, tok) == [0, 5, 8]
    assert prompt_token_ids([{"role": "user", "content": "hello"}], "p", 100, _chat(tok)) == [0, 3, 5, 4]
    with pytest.raises(ValueError, match=r"p\[1\]: token id np.True_ is not an integer"):
        prompt_token_ids([1, np.bool_(True)], "p", 10, None)
    with pytest.raises(ValueError, match=r"p: got a string, but the model has no tokenizer"):
        prompt_token_ids("hi", "p", 10, None)
    with pytest.raises(ValueError, match=r"p: got a conversation, but the model has no tokenizer"):
        prompt_token_ids([{"role": "user", "content": "hi"}], "p", 10, None)
    with pytest.raises(ValueError, match=r"p: tokenizer output \[1\]: token id 5 is outside the vocabulary \[0, 5\)"):
        prompt_token_ids("hello", "p", 5, tok)


def _chat(tok):
    from tests.model.tiny_tokenizer import CHAT_TEMPLATE

    return Tokenizer(tok.backend, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)
