"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole response is the call, optionally after <|python_tag|>.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls may be separated by ";". A response that starts with "{" is held back until it ends, since
only then is it known whether it is a call or plain content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class Llama3JsonToolCallParser(TaggedToolCallParser):
    """Llama 3 JSON calls (``"parameters"`` or ``"arguments"``), after ``<|python_tag|>`` or alone."""

    start_tag = "<|python_tag|>"
    call_format = ToolCallFormat(arguments_key="parameters")
    bare_start = "{"  # a response that opens with it is a call
    end_tag = ""

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


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos
