"""When a request stops, and the text it has produced so far.

A request stops, checked in this order after each generated token, at:

1. a token of its stop set (the model's end-of-sequence ids unless ``ignore_eos``, and its
   ``stop_token_ids``): ``finish_reason="stop"``, ``stop_reason`` = that token;
2. a stop string in its text: "stop", ``stop_reason`` = that string; the text is cut before it;
3. ``max_new_tokens`` generated: "length";
4. ``max_model_len`` tokens in all: "max_model_len".

Streams must not show text that a stop string may yet claim, so :meth:`TextTracker.releasable`
holds back the last ``len(longest stop string) - 1`` characters until the request finishes.
"""

from __future__ import annotations

from ..model.tokenizer import IncrementalDecoder, Tokenizer


class TextTracker:
    """The generated text of one request, decoded token by token, with its stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self._decoder = IncrementalDecoder(tokenizer)
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._released = 0  # characters a stream has been given

    def push(self, token_id: int) -> str | None:
        """Adds a generated token; returns the stop string it completed, if any (the text then
        ends just before it)."""
        start = len(self.text)
        self.text += self._decoder.push(token_id)
        # a match may begin up to len(stop) - 1 characters before the new text
        first = None
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at != -1 and (first is None or at < first[0]):
                first = (at, s)
        if first is None:
            return None
        self.text = self.text[: first[0]]
        return first[1]

    def releasable(self, finished: bool) -> str:
        """Text not given to the stream yet that no stop string can claim any more."""
        end = len(self.text) if finished else max(self._released, len(self.text) - self._hold)
        out = self.text[self._released : end]
        self._released = end
        return out


def finish_reason(tokens_total: int, num_generated: int, token_id: int, stop_ids: frozenset[int],
                  stop_string: str | None, max_new_tokens: int, max_model_len: int) -> tuple[str | None, int | str | None]:
    """(finish_reason, stop_reason) after a token was generated; (None, None) to go on."""
    if token_id in stop_ids:
        return "stop", token_id
    if stop_string is not None:
        return "stop", stop_string
    if num_generated >= max_new_tokens:
        return "length", None
    if tokens_total >= max_model_len:
        return "max_model_len", None
    return None, None
