"""Qwen3-Coder tool calls: XML functions and parameters inside ``<tool_call>`` blocks.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; with the request's tools they are converted to the JSON type their schema
declares (integer, number, boolean, object, array, null), and stay strings otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from core.parsers import Tool
from core_templates.parsers.common import find_tool, tool_properties
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolCallParser(TaggedToolCallParser):
    """``<function=NAME><parameter=P>value</parameter></function>`` calls (Qwen3-Coder)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        calls = []
        for function in _FUNCTION.finditer(body):
            name = function.group(1).strip()
            schema = tool_properties(find_tool(tools, name))
            arguments = {
                match.group(1).strip(): convert(_strip_newline(match.group(2)), schema.get(match.group(1).strip()))
                for match in _PARAMETER.finditer(function.group(2))
            }
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls or None


def _strip_newline(value: str) -> str:
    # The template writes "<parameter=p>\n" + value + "\n</parameter>": drop exactly that framing.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def convert(value: str, schema: Any) -> Any:
    """`value` as the JSON type `schema` declares; the text itself when it does not fit."""
    types = schema.get("type") if isinstance(schema, Mapping) else None
    for kind in types if isinstance(types, list) else [types]:
        if kind == "string":
            return value
        converted = _CONVERTERS.get(kind, _no_conversion)(value.strip())
        if converted is not _NO_FIT:
            return converted
    return value


_NO_FIT = object()


def _no_conversion(text: str) -> Any:
    return _NO_FIT


def _json_of(*kinds: type) -> Any:
    def load(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            return _NO_FIT
        return value if isinstance(value, kinds) and not (bool not in kinds and isinstance(value, bool)) else _NO_FIT

    return load


_CONVERTERS = {
    "integer": _json_of(int),
    "number": _json_of(int, float),
    "boolean": lambda text: {"true": True, "false": False}.get(text.lower(), _NO_FIT),
    "object": _json_of(dict),
    "array": _json_of(list),
    "null": lambda text: None if text.lower() in ("null", "none") else _NO_FIT,
}
