"""Incremental detokenization: UTF-8-safe text deltas and stop strings across token boundaries.

Decoding token by token breaks multi-byte characters (a byte-level BPE token may hold half an emoji) and
loses the leading spaces SentencePiece tokenizers attach to the previous token. So each step decodes a
short window of recent tokens twice (with and without the new ones) and emits the difference, holding
text back while it ends in an incomplete character. Stop strings may span tokens: text that could still
become a stop string is held back until it either completes one (generation stops, the stop string is
dropped unless asked for) or cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.backend import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes with its proper leading space.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    """Text to emit now; `stop` is the stop string that ended generation, if one did."""

    text: str
    stop: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas for one choice."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._text = ""  # all decoded output text
        self._sent = 0  # how much of _text has been emitted
        self.stopped: str | None = None

    @property
    def output_text(self) -> str:
        """The text emitted so far."""
        return self._text[: self._sent]

    def update(self, new_token_ids: Sequence[int], *, final: bool = False) -> TextDelta:
        """Add tokens; `final` flushes everything held back (the choice finished)."""
        if self.stopped is not None:
            return TextDelta("")
        if new_token_ids:
            self._text += self._decode_new(new_token_ids)
        if final:
            self._text += self._decode_held()
        return self._emit(final)

    def _decode_new(self, new_token_ids: Sequence[int]) -> str:
        self._ids.extend(new_token_ids)
        prefix, full = self._decode_window()
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""  # an incomplete character: wait for the rest of its bytes

    def _decode_held(self) -> str:
        """At the end, tokens still held for an incomplete character are decoded as they are: the
        broken bytes become U+FFFD, as in ``tokenizer.decode`` of the whole output."""
        if self._read_offset == len(self._ids):
            return ""
        prefix, full = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _decode_window(self) -> tuple[str, str]:
        """The recent window decoded without and with the tokens not yet turned into text."""
        decode, skip = self._tokenizer.decode, self._skip_special
        window = self._ids[self._prefix_offset :]
        return decode(window[: self._read_offset - self._prefix_offset], skip_special_tokens=skip), \
            decode(window, skip_special_tokens=skip)

    def _emit(self, final: bool) -> TextDelta:
        if self._stop:
            found = self._find_stop()
            if found is not None:
                position, stop = found
                end = position + len(stop) if self._include_stop else position
                return self._advance(end, stop)
        end = len(self._text) if final else self._safe_end()
        return self._advance(end, None)

    def _find_stop(self) -> tuple[int, str] | None:
        # Only text not yet emitted (plus the overlap a stop string could span) needs searching.
        start = max(0, self._sent - self._max_stop_len + 1)
        hits = [(i, s) for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _safe_end(self) -> int:
        """How far text can be emitted without cutting a stop string that may still complete."""
        text = self._text
        for keep in range(min(self._max_stop_len - 1, len(text) - self._sent), 0, -1):
            tail = text[len(text) - keep :]
            if any(s.startswith(tail) for s in self._stop):
                return len(text) - keep
        return len(text)

    def _advance(self, end: int, stop: str | None) -> TextDelta:
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        if stop is not None:
            self.stopped = stop
            self._text = self._text[:end]
        return TextDelta(delta, stop)
