"""Tool-call parsers: whole-text and streamed parsing agree at every cut; malformed output is content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.parsers import ParseContext, ToolCallParser
from core.testing.parsers import collect_tool_calls
from core_templates.parsers.hermes import HermesToolCallParser
from core_templates.parsers.llama3_json import Llama3JsonToolCallParser
from core_templates.parsers.mistral import MistralToolCallParser
from core_templates.parsers.qwen3_coder import Qwen3CoderToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "scale": {"type": "number"}, "note": {"type": ["integer", "string"]}}}}}]
PARIS = {"city": "Paris", "days": 2}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'

# (parser class, model text, expected content, expected [(name, arguments object)])
Case = tuple[type[ToolCallParser], str, str, list[tuple[str, dict[str, Any]]]]
CASES: list[Case] = [
    (HermesToolCallParser, "Let me check.\n\n" + HERMES_CALL, "Let me check.", [("get_weather", PARIS)]),
    (HermesToolCallParser, HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo ünï"), "",
     [("get_weather", PARIS), ("get_weather", {"city": "Oslo ünï", "days": 2})]),
    (HermesToolCallParser, "No tools needed <tool here>.\n", "No tools needed <tool here>.\n", []),
    (HermesToolCallParser, "A\n<tool_call>\n{not json}\n</tool_call>\nB", "A\n<tool_call>\n{not json}\n</tool_call>\nB",
     []),
    (HermesToolCallParser, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}", "", [("f", {"a": 1})]),
    (HermesToolCallParser, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": ", "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": ", []),
    (HermesToolCallParser, "x <tool_ca", "x <tool_ca", []),
    (Llama3JsonToolCallParser, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "",
     [("get_weather", PARIS)]),
    (Llama3JsonToolCallParser, ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
     "", [("a", {}), ("b", {"x": 1})]),
    (Llama3JsonToolCallParser, "Sure <|python_tag|>{\"name\": \"a\", \"parameters\": {}}", "Sure", [("a", {})]),
    (Llama3JsonToolCallParser, '  {"json": "but not a call"}', '  {"json": "but not a call"}', []),
    (Llama3JsonToolCallParser, 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    (Llama3JsonToolCallParser, "<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")", []),
    (MistralToolCallParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "b", "arguments": {}}]', "", [("get_weather", PARIS), ("b", {})]),
    (MistralToolCallParser, 'Checking. [TOOL_CALLS][{"name": "b", "arguments": {"q": "[TOOL_CALLS]"}}]', "Checking.",
     [("b", {"q": "[TOOL_CALLS]"})]),
    (MistralToolCallParser, "[TOOL_CALLS] [{\"name\": 3}]", "[TOOL_CALLS] [{\"name\": 3}]", []),
    (Qwen3CoderToolCallParser, "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n"
     "[1, 2]\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=note>\nabc\n</parameter>\n"
     "</function>\n</tool_call>", "I'll look.",
     [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "scale": 1.5, "note": "abc"})]),
    (Qwen3CoderToolCallParser, "<tool_call>\n<function=other>\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>", "", [("other", {"days": "3"})]),
    (Qwen3CoderToolCallParser, "<tool_call>\n<function=get_weather>\n<parameter=days>\nmany\n</parameter>\n"
     "</function>\n</tool_call>", "", [("get_weather", {"days": "many"})]),
    (Qwen3CoderToolCallParser, "<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
]


def expected_calls(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]


def cuts(text: str) -> list[list[str]]:
    """The text cut in two at every boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def ids(case: Case) -> str:
    return f"{case[0].__name__}:{case[1][:30]!r}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_parse(case: Case) -> None:
    cls, text, content, calls = case
    parsed = cls().parse(text, TOOLS)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected_calls(calls)
    assert all(c.id for c in parsed.tool_calls)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_streaming_matches_parse_at_every_cut(case: Case) -> None:
    cls, text, content, calls = case
    for pieces in cuts(text):
        parser = cls(None).start(ParseContext(tools=TOOLS))
        deltas = [parser.feed(piece) for piece in pieces] + [parser.flush()]
        fragments = [f for d in deltas for f in d.tool_calls]
        firsts = {}
        for fragment in fragments:  # a call's first fragment names it; later ones only add arguments
            if fragment.index not in firsts:
                firsts[fragment.index] = fragment
                assert fragment.id and fragment.name, pieces
            else:
                assert fragment.id is None and fragment.name is None, pieces
        collected = collect_tool_calls(deltas)
        assert collected.content == content, pieces
        assert [(c.name, c.arguments) for c in collected.tool_calls] == expected_calls(calls), pieces


def test_mistral_ids_fit_its_template() -> None:
    call = MistralToolCallParser().parse('[TOOL_CALLS] [{"name": "b", "arguments": {}}]').tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()


def test_context_tools_are_the_default() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    parser = Qwen3CoderToolCallParser().start(ParseContext(tools=TOOLS))
    assert parser.parse(text).tool_calls[0].input() == {"days": 3}
    assert Qwen3CoderToolCallParser().parse(text).tool_calls[0].input() == {"days": "3"}


def test_content_streams_before_the_call() -> None:
    parser = HermesToolCallParser()
    assert parser.feed("Hello ").content == "Hello"
    assert parser.feed("there\n<tool").content == " there"
    delta = parser.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    assert delta.content == "" and delta.tool_calls[0].name == "f"
    assert not parser.flush()
