"""A checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus what
``tokenizer_config.json`` says (BOS / EOS tokens, whether to add BOS, the chat template).

    tok = Tokenizer.from_dir(path)          # None when the directory has no tokenizer.json
    ids = tok.encode("Hello")               # BOS added when the checkpoint asks for it
    tok.decode(ids)                         # special tokens skipped
    tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # -> prompt text (jinja2)

:class:`IncrementalDecoder` turns a growing list of token ids into text deltas for streaming,
never emitting half of a multi-byte character.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .config import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves the template


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode / decode text and render chat templates for one checkpoint.

    Args:
        backend: a ``tokenizers.Tokenizer``.
        bos_token, eos_token: special token strings (None when the checkpoint names none).
        add_bos_token: prepend BOS in :meth:`encode` (unless the tokenizer's own post-processor
            already did).
        chat_template: a jinja2 template (None: :meth:`apply_chat_template` raises).
    """

    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None, source: str = "<memory>"):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        self.source = source
        self._template = None  # compiled on first use: jinja2 is only needed for chat

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
        """The tokenizer saved in a checkpoint directory, or None when it has no tokenizer.json."""
        path = os.fspath(path)
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            return None
        import tokenizers

        try:
            backend = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise ValueError(f"tokenizer: {file!r}: expected a tokenizers JSON file, got: {e}") from None
        config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        config = read_json(config_file) if os.path.isfile(config_file) else {}
        if not isinstance(config, dict):
            raise ValueError(f"tokenizer: {config_file!r}: expected a JSON object, got {type(config).__name__}")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        template_file = os.path.join(path, CHAT_TEMPLATE_FILE)
        if template is None and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        tok = cls(
            backend, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)), chat_template=template, source=path,
        )
        for name in ("bos_token", "eos_token"):
            text = getattr(tok, name)
            if text is not None and getattr(tok, name + "_id") is None:
                raise ValueError(f"tokenizer: {config_file!r}: {name}: expected a token of {file!r}, got {text!r}")
        return tok

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the checkpoint's BOS comes first."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation ([{"role": ..., "content": ...}, ...]), rendered with
        the checkpoint's chat template. The text already holds the template's special tokens:
        encode it with ``add_special_tokens=False``."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer: apply_chat_template: expected a checkpoint with a chat template, "
                             f"got {self.source!r} without one")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers chat templates commonly call."""
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"tokenizer: chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"tokenizer: chat_template: expected a jinja2 template, got a syntax error at line {e.lineno}: {e}") from None


class IncrementalDecoder:
    """Text deltas of a growing token sequence (streaming).

    Decoding each new token alone is wrong (a character may span tokens, and decoders strip or
    merge spaces across token boundaries), and decoding everything each time is quadratic.
    So: decode a short window that ends at the new token and one that ends just before it,
    both from the same start, and emit the difference once it does not end in U+FFFD (half a
    UTF-8 character, to be finished by a later token).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], self.skip_special_tokens)
        after = decode(self.ids[self._prefix :], self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]
