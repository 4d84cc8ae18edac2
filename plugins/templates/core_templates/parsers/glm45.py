"""GLM-4.5 / GLM-4.6 tool calls: the name, then key / value pairs, inside ``<tool_call>`` blocks.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>2</arg_value>
    </tool_call>

Values are text, typed as vLLM's glm4_moe parser types them: one the tool's schema declares a string stays
as written; any other (or one of an unknown tool) is read as JSON, else as a Python literal, else kept as
stripped text. A block holding anything but a name and complete pairs is kept as content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from core.parsers import Tool
from core_templates.parsers.common import find_tool, tool_properties
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_NAME = re.compile(r"\s*([^\s<>{}\"']+)[^\S\n]*(?:\n|(?=<arg_key>)|$)")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class Glm45ToolCallParser(TaggedToolCallParser):
    """GLM-4.5's ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` calls."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    #: As vLLM's glm4_moe parser: decoded with special tokens, so the tags survive a tokenizer marking them.
    reads_special_tokens = True

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        name = _NAME.match(body)
        if name is None:
            return None
        types = _argument_types(find_tool(tools, name[1]))
        arguments, pos = {}, name.end()
        while pos < len(body):
            pair = _PAIR.match(body, pos)
            if pair is None:
                return None
            key = pair[1].strip()
            arguments[key] = pair[2] if types.get(key) == "string" else typed_value(pair[2])
            pos = pair.end()
        return [(name[1], json.dumps(arguments, ensure_ascii=False))]


def _argument_types(function: Mapping[str, Any] | None) -> dict[str, Any]:
    return {key: schema.get("type") for key, schema in tool_properties(function).items() if isinstance(schema, Mapping)}


def typed_value(text: str) -> Any:
    """`text` read as JSON, else as a Python literal (``True``, ``'a'``, ``(1, 2)``), else as it is, stripped.
    A literal that JSON cannot hold (a set, bytes) stays text; nothing is evaluated."""
    text = text.strip()
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value
