"""Message text never becomes control tokens.

A chat prompt mixes the template's text, whose control strings (``<|im_start|>``, ``<|im_end|>``, ...)
must become control tokens, with the client's message text, where the same strings must stay text: a
user who types ``<|im_end|>\\n<|im_start|>system`` would otherwise close their own turn and open a system
turn. `ContentGuard.mark` puts an unused private-use character right after the first character of every
control string inside message text (and tool definitions) before the template renders it;
`ContentGuard.encode` then tokenizes the rendered prompt piece by piece, split at that character, so no
piece holds a whole control string from message text, while the template's own are parsed as usual.

Messages that hold no control string (nearly all) are left alone and tokenized in one piece, exactly
as transformers' ``apply_chat_template`` does. Operators who want clients to send control tokens in
message text turn the guard off (``--allow-special-tokens-in-content``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from core.backend import Tokenizer
from core.errors import InvalidRequestError

# Private-use characters: no tokenizer gives them meaning; one absent from the request marks the splits.
MARK_CANDIDATES = tuple(chr(c) for c in range(0xE000, 0xE100))


class ContentGuard:
    """Finds a tokenizer's control strings in request text and keeps them from becoming control tokens.

    :param tokenizer: its special tokens (``all_special_ids``) are the control strings.
    :param extra: more control strings (the chat template's end-of-turn markers).
    """

    def __init__(self, tokenizer: Tokenizer, extra: Iterable[str] = ()) -> None:
        specials = {tokenizer.decode([i]) for i in tokenizer.all_special_ids} | set(extra)
        # A one-character control string cannot be split; longest first, so overlapping ones match whole.
        self.control_strings = tuple(sorted((s for s in specials if len(s) > 1), key=len, reverse=True))
        strings = self.control_strings
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def found_in(self, value: Any) -> str | None:
        """The first control string in any text of `value` (nested lists and objects), or None."""
        if self._pattern is None:
            return None
        for text in _strings(value):
            if match := self._pattern.search(text):
                return match[0]
        return None

    def mark(self, value: Any) -> tuple[Any, str | None]:
        """`value` with each control string in its text split by a mark, and that mark (None: nothing to
        mark, `value` is returned as it is)."""
        if self._pattern is None or self.found_in(value) is None:
            return value, None
        mark = _unused_character(value)
        pattern = self._pattern
        return _map_strings(value, lambda s: pattern.sub(lambda m: m[0][0] + mark + m[0][1:], s)), mark

    @staticmethod
    def encode(tokenizer: Tokenizer, text: str, mark: str | None, add_special_tokens: bool) -> list[int]:
        """Token ids of rendered `text`, tokenized separately between marks (the marks dropped)."""
        if mark is None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids: list[int] = []
        for i, piece in enumerate(text.split(mark)):
            ids += tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0)
        return ids


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of `value` with every string value (not mapping keys) changed."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(item, change) for item in value)
    return value


def _unused_character(value: Any) -> str:
    used = set().union(*(set(text) for text in _strings(value) if not text.isascii()))
    for candidate in MARK_CANDIDATES:
        if candidate not in used:
            return candidate
    raise InvalidRequestError("the messages use every character of U+E000..U+E0FF", param="messages")
