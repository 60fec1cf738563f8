"""mlagraph.model.tokenizer: reading a checkpoint's tokenizer files, BOS handling, the chat
template, and incremental (streaming) decoding; and generation_config's EOS ids."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mlagraph.model.generation_config import eos_token_ids
from mlagraph.model.tokenizer import IncrementalDecoder, Tokenizer

from .tiny_tokenizer import CHAT_TEMPLATE, write_tokenizer


@pytest.fixture
def tok_dir(tmp_path):
    write_tokenizer(tmp_path)
    return tmp_path


def test_no_tokenizer_json_means_no_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


def test_encode_adds_bos_once_and_decode_skips_specials(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    ids = tok.encode("hello world")
    assert ids == [0, 5, 6]
    assert tok.encode("hello world", add_special_tokens=False) == [5, 6]
    assert tok.encode("<s> hello") == [0, 5]  # BOS already there: not added twice
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids + [1], skip_special_tokens=False) == "<s> hello world </s>"


def test_add_bos_token_false_is_respected(tmp_path):
    write_tokenizer(tmp_path, add_bos_token=False)
    assert Tokenizer.from_dir(tmp_path).encode("hello") == [5]


def test_chat_template_renders_with_jinja(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    msgs = [{"role": "user", "content": "hello cat"}]
    assert tok.apply_chat_template(msgs) == "<s><user> hello cat <assistant>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<s><user> hello cat "
    assert tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False) == [0, 3, 5, 8, 4]


def test_chat_template_from_named_list_and_from_jinja_file(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    assert Tokenizer.from_dir(tmp_path).chat_template is None
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert Tokenizer.from_dir(tmp_path).chat_template == CHAT_TEMPLATE
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 'ok' }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "ok"


def test_tokenizer_errors_name_the_file(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match=r"apply_chat_template: expected a checkpoint with a chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>",')
    with pytest.raises(ValueError, match=r"tokenizer_config.json.*expected valid JSON.*line 1"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<nope>"}')
    with pytest.raises(ValueError, match=r"bos_token: expected a token of .*tokenizer.json', got '<nope>'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(ValueError, match=r"chat_template: expected a jinja2 template, got a syntax error"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json': expected a tokenizers JSON file"):
        Tokenizer.from_dir(tmp_path)


def _byte_level_bpe() -> Tokenizer:
    """Byte-level BPE trained here on ASCII only, so multi-byte characters stay split in bytes."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello world and more text", "naive cafe done"] * 4, trainer)
    return Tokenizer(hf)


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 and more 日本", "naïve café! 🙂 done"])
def test_incremental_decoder_reassembles_text_and_never_splits_a_character(text):
    tok = _byte_level_bpe()
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some characters do span tokens here, so the hold-back was exercised


def test_eos_ids_generation_config_overrides_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert eos_token_ids(tmp_path, vocab_size=10) == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1, 3]}))
    assert eos_token_ids(tmp_path, vocab_size=10) == (3, 1)
    assert eos_token_ids({"eos_token_id": None}, vocab_size=10) == ()
    assert eos_token_ids({"eos_token_id": [2, 4]}, vocab_size=10) == (2, 4)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 12}))
    with pytest.raises(ValueError, match=r"generation_config.json'.*eos_token_id: expected token ids in \[0, 10\), got 12"):
        eos_token_ids(tmp_path, vocab_size=10)
