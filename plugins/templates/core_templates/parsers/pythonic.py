"""Pythonic tool calls (Llama 3.2 / Llama 4 with a pythonic template, ToolACE): a Python list of calls.

    [get_weather(city="Paris", days=2), get_time(zone="CET")]

The list is the whole response, or what ``<|python_start|>`` opens (Llama 4 may write that marker; it ends
at ``<|python_end|>``). It is read with `ast` and its argument values with `ast.literal_eval`, so nothing is
ever evaluated: a call whose name is not a plain name, with positional arguments, or with a value that is
not a literal JSON can hold, makes the whole list content. A response that starts with "[" is held back
until it ends, since only then is it known whether it is a list of calls or plain content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence

from core.parsers import Tool
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_UNREADABLE = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


class PythonicToolCallParser(TaggedToolCallParser):
    """A response that is a Python list of calls, ``[f(a=1), g(b="x")]``."""

    start_tag = "<|python_start|>"
    bare_start = "["  # a response that opens with it is a call
    end_tag = "<|python_end|>"

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        return pythonic_calls(body)


def pythonic_calls(source: str) -> list[Call] | None:
    """The calls of a Python list of calls, ``[f(a=1), g()]``; None when `source` is anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except _UNREADABLE:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(node) for node in tree.body.elts]
    return None if None in calls else calls  # type: ignore[return-value]


def _call(node: ast.expr) -> Call | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except _UNREADABLE:
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except _UNREADABLE:
        return None
