"""Text helpers shared by the streaming parsers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def partial_tag_length(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags` (held back while
    streaming, because the next delta may complete the tag)."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


def split_trailing_space(text: str) -> tuple[str, str]:
    """(text without trailing whitespace, the trailing whitespace)."""
    stripped = text.rstrip()
    return stripped, text[len(stripped):]


def find_tool(tools: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any] | None:
    """The function definition called `name` among OpenAI-style tools, or None."""
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            return function
    return None


def tool_properties(function: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The JSON-schema ``properties`` of a tool's parameters (`function` as ``find_tool`` gives it), or {}."""
    parameters = function.get("parameters") if function else None
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return properties if isinstance(properties, Mapping) else {}


def arguments_json(arguments: Any) -> str | None:
    """Tool-call arguments as JSON object text; None when they are not an object (malformed output)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply to read
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)
