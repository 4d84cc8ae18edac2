"""Kimi K2 tool calls: a section of calls, each named by an id ``functions.NAME:INDEX``.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The model's own id is the call's id: Kimi's template writes it back into the conversation
(``## Return of functions.get_weather:0``), so the model must see the one it wrote. A section holding
anything but complete calls (whitespace between them aside) is kept as content.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from core.parsers import Tool
from core_templates.parsers.common import arguments_json
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*([^<\s]+?)\s*<\|tool_call_argument_begin\|>(.*?)"
                   r"<\|tool_call_end\|>\s*", re.DOTALL)
_ID = re.compile(r"(?:[^:]*\.)?([^.:]+):\d+")  # "functions.NAME:INDEX" (or "NAME:INDEX")


class KimiK2ToolCallParser(TaggedToolCallParser):
    """Kimi K2's ``<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`` calls."""

    start_tag = "<|tool_calls_section_begin|>"
    end_tag = "<|tool_calls_section_end|>"

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._ids: list[str] = []  # the ids of the block just parsed, handed out in order

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        calls, ids, pos = [], [], 0
        while pos < len(body) or not calls:
            match = _CALL.match(body, pos)
            name = _ID.fullmatch(match[1]) if match else None
            arguments = arguments_json(match[2]) if match and name else None
            if arguments is None:
                return None
            calls.append((name[1], arguments))  # type: ignore[index]
            ids.append(match[1])  # type: ignore[index]
            pos = match.end()  # type: ignore[union-attr]
        self._ids = ids
        return calls

    def new_tool_call_id(self) -> str:
        # The base asks for one id per call of the block parse_block has just read, in order.
        return self._ids.pop(0) if self._ids else super().new_tool_call_id()
