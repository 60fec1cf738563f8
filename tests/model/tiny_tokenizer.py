"""A tiny word-level tokenizer, written beside test checkpoints (no downloads).

Ids 0, 1, 2 are <s>, </s>, <unk> — transformers' DeepSeek configs default to bos 0 and eos 1,
so the saved checkpoint's EOS is this tokenizer's </s>. The other ids are plain words, few
enough (< conftest.VOCAB) that every id is inside the model's vocabulary.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL = ["<s>", "</s>", "<unk>"]
WORDS = ["<user>", "<assistant>", "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"] + [
    f"w{i}" for i in range(60)
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> Tokenizer:
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    return tok


def write_tokenizer(path, chat_template: str | None = CHAT_TEMPLATE, add_bos_token: bool = True) -> None:
    """tokenizer.json + tokenizer_config.json (as transformers writes them) into ``path``."""
    tiny_tokenizer().save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "add_bos_token": add_bos_token}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
