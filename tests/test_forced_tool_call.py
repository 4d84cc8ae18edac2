"""A forced tool call on a server without a tool-call parser: the bare JSON call object read back as a call,
whole and streamed, and the postprocessor that uses it only for forced calls."""

from __future__ import annotations

import json

import pytest

from core.forced_tool_call import ForcedCallParser
from core.server.postprocess import Postprocessors

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}'


def test_the_call_object_is_one_call():
    parsed = ForcedCallParser().parse(CALL)
    assert parsed.content == "" and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Zürich", "days": 2} and "Zürich" in call.arguments


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": ',  # cut short by max_tokens
    '{"name": "get_weather", "arguments": "city"}',  # arguments not an object
    '{"name": 3, "arguments": {}}',
    '{"name": "get_weather", "arguments": {}, "extra": 1}',
    '[{"name": "get_weather", "arguments": {}}]',
    "plain words",
])
def test_anything_else_is_plain_content(text):
    parser = ForcedCallParser()
    assert parser.parse(text).content == text and not parser.parse(text).tool_calls
    assert parser.feed(text).content == "" and parser.flush().content == text


@pytest.mark.parametrize("cut", [1, 7, len(CALL) - 1])
def test_streamed_the_call_comes_whole_at_the_end(cut):
    parser = ForcedCallParser()
    assert not parser.feed(CALL[:cut]) and not parser.feed(CALL[cut:])
    start, arguments = parser.flush().tool_calls
    assert (start.index, start.name, arguments.index, arguments.name) == (0, "get_weather", 0, None)
    assert start.id.startswith("call_") and json.loads(arguments.arguments) == {"city": "Zürich", "days": 2}


def test_a_server_without_a_parser_reads_only_forced_calls():
    plain = Postprocessors()
    assert plain.tool_call_format is None
    assert plain.for_request("", TOOLS).final(CALL).content == CALL  # tool_choice auto: plain content
    forced = plain.for_request("", TOOLS, forced_call=True)
    parts = forced.final(CALL)
    assert parts.content is None and [c.name for c in parts.tool_calls] == ["get_weather"]
    pieces = forced.delta(0, CALL[:10]) + forced.delta(0, CALL[10:], finished=True)
    assert [p.kind for p in pieces] == ["tool_call", "arguments"] and forced.called_tools(0)
