"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole response is the call, optionally after <|python_tag|>.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls may be separated by ";". A response that starts with "{" is held back until it ends, since
only then is it known whether it is a call or plain content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class Llama3JsonToolCallParser(TaggedToolCallParser):
    """Llama 3 JSON calls (``"parameters"`` or ``"arguments"``), after ``<|python_tag|>`` or alone."""

    start_tag = "<|python_tag|>"
    call_format = ToolCallFormat(arguments_key="parameters")
    end_tag = ""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._at_start = True  # a "{" opens a call only at the very start of the response

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while (pos := _skip_separators(body, pos)) < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return None
            call = json_call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def _find_start(self, text: str, pos: int, at_start: bool) -> tuple[int, int] | None:
        rest = text[pos:].lstrip()
        if at_start and rest.startswith("{"):
            return pos, len(text) - len(rest)
        return super()._find_start(text, pos, at_start)

    def _stream_start(self, buffer: str) -> tuple[int, int] | None:
        at_start = self._at_start
        self._at_start = at_start and not buffer.strip()  # leading whitespace keeps the start open
        return self._find_start(buffer, 0, at_start)

def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos
