"""What a request is: its sampling parameters, its state while it runs, and what it returns.

A prompt is a list of token ids, a string (encoded with the model's tokenizer) or a
conversation — a list of ``{"role": ..., "content": ...}`` dicts, rendered with the
tokenizer's chat template. :func:`prompt_token_ids` turns any of them into token ids, checking
everything before the engine's state changes.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .stopping import TextTracker

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request and when to stop it.

    max_new_tokens: tokens to generate at most. temperature: 0 is greedy. stop_token_ids: stop
    after generating any of these. stop: stop strings (the text is cut before the match; needs
    a tokenizer). ignore_eos: go on past the model's end-of-sequence tokens.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def checked(cls, caller: str, vocab_size: int, *, max_new_tokens=16, temperature=0.0, stop_token_ids=None,
                stop=None, ignore_eos=False) -> SamplingParams:
        """Validated parameters; a ValueError naming ``caller`` and the argument otherwise."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"{caller}: max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0
                or not math.isfinite(temperature)):
            raise ValueError(f"{caller}: temperature: expected a finite number >= 0, got {temperature!r}")
        if isinstance(stop_token_ids, (int, str)) or not isinstance(stop_token_ids, (Sequence, set, frozenset, type(None))):
            raise ValueError(f"{caller}: stop_token_ids: expected a list of token ids or None, got {stop_token_ids!r}")
        ids = tuple(_token_id(t, f"{caller}: stop_token_ids[{i}]", vocab_size) for i, t in enumerate(stop_token_ids or ()))
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (Sequence, type(None))) or any(not isinstance(s, str) or not s for s in stop or ()):
            raise ValueError(f"{caller}: stop: expected a string or a list of non-empty strings, got {stop!r}")
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"{caller}: ignore_eos: expected a bool, got {ignore_eos!r}")
        return cls(max_new_tokens, float(temperature), ids, tuple(stop or ()), ignore_eos)


def _token_id(tok, where: str, vocab_size: int) -> int:
    """An int token id (numpy and torch integer scalars welcome) inside the vocabulary."""
    if isinstance(tok, bool) or type(tok).__name__ == "bool_":
        raise ValueError(f"{where}: token id {tok!r} is not an integer")
    try:
        value = operator.index(tok)
    except TypeError:
        raise ValueError(f"{where}: token id {tok!r} is not an integer") from None
    if not 0 <= value < vocab_size:
        raise ValueError(f"{where}: token id {tok!r} is outside the vocabulary [0, {vocab_size})")
    return value


def _is_conversation(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def prompt_token_ids(prompt, where: str, vocab_size: int, tokenizer) -> list[int]:
    """Token ids of one prompt (ids, text or conversation); a ValueError naming ``where``."""
    if isinstance(prompt, str) or _is_conversation(prompt):
        if tokenizer is None:
            kind = "a string" if isinstance(prompt, str) else "a conversation"
            raise ValueError(f"{where}: got {kind}, but the model has no tokenizer (its checkpoint has no "
                             f"tokenizer.json): give token ids instead")
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            ids = tokenizer.encode(tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        if not ids:
            raise ValueError(f"{where}: expected at least one token, got {prompt!r}, which encodes to none")
        for j, tok in enumerate(ids):
            _token_id(tok, f"{where}: tokenizer output [{j}]", vocab_size)
        return ids
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # numpy array, torch tensor
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"{where}: expected a list of token ids, got {type(prompt).__name__} "
                         f"(strings and conversations work with a tokenizer)")
    if len(prompt) == 0:
        raise ValueError(f"{where}: expected at least one token, got an empty prompt")
    return [_token_id(tok, f"{where}[{j}]", vocab_size) for j, tok in enumerate(prompt)]


@dataclasses.dataclass
class Request:
    """One request's state in the engine.

    ``tokens`` are the prompt and the tokens generated so far; the first ``num_cached`` of them
    have their latents in the cache at ``pages`` (``page_hashes``: the prefix cache's keys of
    the pages handled so far). ``num_cached_prompt_tokens`` of the prompt came from the prefix
    cache instead of being computed.
    """

    id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # end-of-sequence ids (unless ignore_eos) and stop_token_ids
    text: TextTracker | None = None  # with a tokenizer: the generated text and stop strings
    pages: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    num_cached_prompt_tokens: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # speculative decoding: the drafts to verify next, and the distributions [k, V] they were drawn from
    draft: list[int] = dataclasses.field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def decoding(self) -> bool:
        return self.num_cached >= self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def output(self) -> GenerationOutput:
        return GenerationOutput(
            token_ids=self.tokens[self.prompt_len :], logprobs=list(self.logprobs), finish_reason=self.finish_reason,
            prompt_len=self.prompt_len, request_id=self.id, stop_reason=self.stop_reason,
            text=self.text.text if self.text is not None else None,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
        )


@dataclasses.dataclass
class GenerationOutput:
    """What one request produced.

    token_ids: generated tokens; logprobs: log p(token) under the model (temperature 1);
    text: the generated text (None without a tokenizer), cut before a matched stop string;
    finish_reason: "stop" (an end-of-sequence token, a stop token or a stop string: which one
    is ``stop_reason``), "length" (max_new_tokens) or "max_model_len".
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_len: int
    request_id: int = 0
    stop_reason: int | str | None = None
    text: str | None = None
    num_cached_prompt_tokens: int = 0

    def describe(self) -> str:
        """``finish_reason=stop (eos token 1)``: the labelled finish reason, for printouts."""
        why = f"finish_reason={self.finish_reason}"
        if isinstance(self.stop_reason, str):
            return f"{why} (stop string {self.stop_reason!r})"
        if self.stop_reason is not None:
            return f"{why} (token {self.stop_reason})"
        return why


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """One step of one request in :meth:`Engine.generate_stream`: the token it generated, the
    text that token completed ("" while a character or a possible stop string is pending;
    None without a tokenizer), and on its last chunk the finish reason."""

    index: int  # position of the request in the prompts given
    token_id: int
    text: str | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
