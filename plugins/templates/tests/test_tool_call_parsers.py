"""Tool-call parsers: whole-text and streamed parsing agree at every cut; malformed output is content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.parsers import ParseContext, ToolCallParser
from core.testing.parsers import collect_tool_calls
from core_templates.parsers.deepseek import DeepSeekV3ToolCallParser, DeepSeekV31ToolCallParser
from core_templates.parsers.glm45 import Glm45ToolCallParser, typed_value
from core_templates.parsers.hermes import Granite4ToolCallParser, HermesToolCallParser
from core_templates.parsers.jamba import JambaToolCallParser
from core_templates.parsers.kimi_k2 import KimiK2ToolCallParser
from core_templates.parsers.lfm2 import Lfm2ToolCallParser
from core_templates.parsers.llama3_json import Llama3JsonToolCallParser
from core_templates.parsers.minimax import MiniMaxToolCallParser
from core_templates.parsers.mistral import MistralToolCallParser
from core_templates.parsers.nemotron import NemotronJsonToolCallParser
from core_templates.parsers.pythonic import PythonicToolCallParser
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


OSLO = {"city": "Oslo ünï 東京", "days": 3}

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def v3_call(name: str, arguments: dict[str, Any]) -> str:
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(arguments, ensure_ascii=False)}"
            "\n```<｜tool▁call▁end｜>")


def v31_call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"


def kimi_call(call_id: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def glm_call(name: str, *pairs: tuple[str, str]) -> str:
    written = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in pairs)
    return f"<tool_call>{name}\n{written}</tool_call>"


V3_TWO = CALLS_BEGIN + v3_call("get_weather", PARIS) + "\n" + v3_call("get_weather", OSLO) + CALLS_END
V31_TWO = CALLS_BEGIN + v31_call("get_weather", json.dumps(PARIS)) + v31_call("get_time", "{}") + CALLS_END
GLM_TYPED = glm_call("get_weather", ("city", "42"), ("days", "3"), ("metric", "true"), ("hours", "[1, 2]"))

# DeepSeek V3 / V3.1, Kimi K2, GLM-4.5 and pythonic calls
CASES += [
    (DeepSeekV3ToolCallParser, "Let me check.\n\n" + V3_TWO, "Let me check.",
     [("get_weather", PARIS), ("get_weather", OSLO)]),
    (DeepSeekV3ToolCallParser, CALLS_BEGIN + v3_call("get_weather", PARIS), "", [("get_weather", PARIS)]),
    (DeepSeekV3ToolCallParser, V3_TWO + "\nDone.", "Done.", [("get_weather", PARIS), ("get_weather", OSLO)]),
    (DeepSeekV3ToolCallParser, CALLS_BEGIN + v3_call("f", PARIS).replace("```json", "```") + CALLS_END, "",
     [("f", PARIS)]),
    (DeepSeekV3ToolCallParser, V31_TWO, V31_TWO, []),  # V3.1's calls are not V3's
    (DeepSeekV3ToolCallParser, CALLS_BEGIN + v3_call("f", PARIS).replace("}", "") + CALLS_END,
     CALLS_BEGIN + v3_call("f", PARIS).replace("}", "") + CALLS_END, []),
    (DeepSeekV3ToolCallParser, "A <｜tool▁calls", "A <｜tool▁calls", []),
    (DeepSeekV31ToolCallParser, "Sure.\n" + V31_TWO, "Sure.", [("get_weather", PARIS), ("get_time", {})]),
    (DeepSeekV31ToolCallParser, CALLS_BEGIN + v31_call("get_weather", json.dumps(OSLO, ensure_ascii=False)), "",
     [("get_weather", OSLO)]),
    (DeepSeekV31ToolCallParser, V3_TWO, V3_TWO, []),  # V3's calls are not V3.1's
    (DeepSeekV31ToolCallParser, CALLS_BEGIN + v31_call("f", "[1]") + CALLS_END,
     CALLS_BEGIN + v31_call("f", "[1]") + CALLS_END, []),
    (DeepSeekV31ToolCallParser, CALLS_BEGIN + " junk " + CALLS_END, CALLS_BEGIN + " junk " + CALLS_END, []),
    (KimiK2ToolCallParser, "I'll check. " + kimi_section(kimi_call("functions.get_weather:0", json.dumps(PARIS)),
                                                         kimi_call("functions.get_weather:1", json.dumps(OSLO))),
     "I'll check.", [("get_weather", PARIS), ("get_weather", OSLO)]),
    (KimiK2ToolCallParser, kimi_section(kimi_call(" get_time:3 ", "{}")), "", [("get_time", {})]),
    (KimiK2ToolCallParser, kimi_section(kimi_call("functions.get_time", "{}")),
     kimi_section(kimi_call("functions.get_time", "{}")), []),
    (KimiK2ToolCallParser, kimi_section(kimi_call("functions.f:0", '{"a": ')),
     kimi_section(kimi_call("functions.f:0", '{"a": ')), []),
    (KimiK2ToolCallParser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", []),
    (Glm45ToolCallParser, "Checking.\n" + GLM_TYPED, "Checking.",
     [("get_weather", {"city": "42", "days": 3, "metric": True, "hours": [1, 2]})]),
    (Glm45ToolCallParser, glm_call("other", ("n", "42"), ("s", "Paris"), ("b", "True"), ("d", "{'a': (1, 2)}"),
                                   ("x", " {1, 2} ")) + "\n" + glm_call("get_time"), "",
     [("other", {"n": 42, "s": "Paris", "b": True, "d": {"a": [1, 2]}, "x": "{1, 2}"}), ("get_time", {})]),
    (Glm45ToolCallParser, glm_call("get_weather", ("city", " 東京\n")), "", [("get_weather", {"city": " 東京\n"})]),
    (Glm45ToolCallParser, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', []),
    (Glm45ToolCallParser, "<tool_call>f\n<arg_key>a</arg_key>oops</tool_call>",
     "<tool_call>f\n<arg_key>a</arg_key>oops</tool_call>", []),
    (Glm45ToolCallParser, "No call <tool", "No call <tool", []),
    (PythonicToolCallParser, '[get_weather(city="Paris", days=2), get_weather(city=\'Oslo ünï 東京\', days=3)]', "",
     [("get_weather", PARIS), ("get_weather", OSLO)]),
    (PythonicToolCallParser, ' \n[f(flag=True, none=None, neg=-1.5, items=[1, (2, 3)], d={"k": "v"})]\n', "",
     [("f", {"flag": True, "none": None, "neg": -1.5, "items": [1, [2, 3]], "d": {"k": "v"}})]),
    (PythonicToolCallParser, "<|python_start|>[get_time()]<|python_end|>", "", [("get_time", {})]),
    (PythonicToolCallParser, "[a link](http://example.com) is plain text",
     "[a link](http://example.com) is plain text", []),
    (PythonicToolCallParser, "Sure: [f(x=1)]", "Sure: [f(x=1)]", []),
    (PythonicToolCallParser, "[f(1)]", "[f(1)]", []),
    (PythonicToolCallParser, "[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),
    (PythonicToolCallParser, "[f(x=g())]", "[f(x=g())]", []),
    (PythonicToolCallParser, "[f(x={1, 2})]", "[f(x={1, 2})]", []),
    (PythonicToolCallParser, "[f(**k)]", "[f(**k)]", []),
    (PythonicToolCallParser, "[f(x=1)", "[f(x=1)", []),
    (PythonicToolCallParser, "[]", "[]", []),
]

LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
PARIS_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
OSLO_JSON = json.dumps({"name": "get_weather", "arguments": OSLO}, ensure_ascii=False)
TIME_JSON = '{"name": "get_time", "arguments": {}}'

# LFM2 / LFM2.5, Jamba, Nemotron's <TOOLCALL>, MiniMax and Granite 4.0 calls
CASES += [
    (Lfm2ToolCallParser, LFM2_START + '[get_weather(city="Paris", days=2)]' + LFM2_END + "Let me check that.",
     "Let me check that.", [("get_weather", PARIS)]),
    (Lfm2ToolCallParser, "Sure.\n" + LFM2_START + "[get_weather(city='Oslo ünï 東京', days=3), get_time()]" + LFM2_END,
     "Sure.", [("get_weather", OSLO), ("get_time", {})]),
    (Lfm2ToolCallParser, LFM2_START + "[" + PARIS_JSON + "]" + LFM2_END, "", [("get_weather", PARIS)]),  # llama.cpp's
    (Lfm2ToolCallParser, LFM2_START + "[get_time()]", "", [("get_time", {})]),  # cut off before the end token
    (Lfm2ToolCallParser, LFM2_START + "[get_weather(city=)]" + LFM2_END, LFM2_START + "[get_weather(city=)]" + LFM2_END,
     []),
    (Lfm2ToolCallParser, LFM2_START + "[]" + LFM2_END, LFM2_START + "[]" + LFM2_END, []),
    (Lfm2ToolCallParser, '[get_weather(city="Paris")]', '[get_weather(city="Paris")]', []),  # no tokens, no call
    (Lfm2ToolCallParser, "Hi <|tool_call_st", "Hi <|tool_call_st", []),
    (JambaToolCallParser, "Let me check. <tool_calls>[\n" + PARIS_JSON + ",\n" + TIME_JSON + "\n]</tool_calls>",
     "Let me check.", [("get_weather", PARIS), ("get_time", {})]),
    (JambaToolCallParser, '<tool_calls>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}'
     "</tool_calls>", "", [("get_weather", PARIS)]),
    (JambaToolCallParser, '<tool_calls>[{"name": "get_weather"</tool_calls>', '<tool_calls>[{"name": "get_weather"</tool_calls>',
     []),
    (JambaToolCallParser, "<tool_calls>[]</tool_calls>", "<tool_calls>[]</tool_calls>", []),
    (JambaToolCallParser, "A list of <tool_calls> is fine.", "A list of <tool_calls> is fine.", []),
    (NemotronJsonToolCallParser, "I will look it up.\n\n<TOOLCALL>[" + PARIS_JSON + ", " + TIME_JSON + "]</TOOLCALL>",
     "I will look it up.", [("get_weather", PARIS), ("get_time", {})]),
    (NemotronJsonToolCallParser, "<TOOLCALL>[" + OSLO_JSON + "]</TOOLCALL>\n", "", [("get_weather", OSLO)]),
    (NemotronJsonToolCallParser, '<TOOLCALL>[{"name": "get_weather", "arguments": [1]}]</TOOLCALL>',
     '<TOOLCALL>[{"name": "get_weather", "arguments": [1]}]</TOOLCALL>', []),
    (NemotronJsonToolCallParser, "<TOOLCALL>not json</TOOLCALL>", "<TOOLCALL>not json</TOOLCALL>", []),
    (NemotronJsonToolCallParser, "<TOOLCALL>[" + PARIS_JSON + ', {"name": 3}]</TOOLCALL>',  # one bad call: all content
     "<TOOLCALL>[" + PARIS_JSON + ', {"name": 3}]</TOOLCALL>', []),
    (MiniMaxToolCallParser, "Checking both.\n<tool_calls>\n" + PARIS_JSON + "\n" + TIME_JSON + "\n</tool_calls>",
     "Checking both.", [("get_weather", PARIS), ("get_time", {})]),
    (MiniMaxToolCallParser, "<tool_calls>\n" + OSLO_JSON + "\n</tool_calls>\nDone.", "Done.", [("get_weather", OSLO)]),
    (MiniMaxToolCallParser, "<tool_calls>\n" + PARIS_JSON + "\noops\n</tool_calls>",
     "<tool_calls>\n" + PARIS_JSON + "\noops\n</tool_calls>", []),
    (MiniMaxToolCallParser, "<tool_calls>\n</tool_calls>", "<tool_calls>\n</tool_calls>", []),
    (MiniMaxToolCallParser, "<tool_calls>[" + TIME_JSON + "]</tool_calls>", "<tool_calls>[" + TIME_JSON + "]</tool_calls>",
     []),  # Jamba's list is not MiniMax's format
    (Granite4ToolCallParser, "Let me check.\n\n" + HERMES_CALL, "Let me check.", [("get_weather", PARIS)]),
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


@pytest.mark.parametrize("cls", [Lfm2ToolCallParser, JambaToolCallParser, NemotronJsonToolCallParser,
                                 Granite4ToolCallParser])
def test_formats_of_special_tokens_are_read_with_them(cls: type[ToolCallParser]) -> None:
    # their tags are special tokens (or may be): decoded without them, no call could ever be found
    assert cls().reads_special_tokens is True


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


def test_kimi_ids_are_the_models_own() -> None:
    text = kimi_section(kimi_call("functions.get_weather:4", "{}"), kimi_call("functions.get_time:5", "{}"))
    assert [c.id for c in KimiK2ToolCallParser().parse(text).tool_calls] == [
        "functions.get_weather:4", "functions.get_time:5"]
    for pieces in cuts(text):
        parser = KimiK2ToolCallParser()
        deltas = [parser.feed(piece) for piece in pieces] + [parser.flush()]
        assert [f.id for d in deltas for f in d.tool_calls] == ["functions.get_weather:4", "functions.get_time:5"]


def test_glm_values_follow_the_request_tools() -> None:
    parser = Glm45ToolCallParser().start(ParseContext(tools=TOOLS))
    assert parser.parse(GLM_TYPED).tool_calls[0].input()["city"] == "42"  # declared a string
    assert Glm45ToolCallParser().parse(GLM_TYPED).tool_calls[0].input()["city"] == 42  # no tools: typed


@pytest.mark.parametrize(("text", "value"), [
    ("3", 3), (" 2.5 ", 2.5), ("null", None), ("None", None), ("'a'", "a"), ('"b"', "b"), ("[1, 'x']", [1, "x"]),
    ("b'x'", "b'x'"), ("__import__('os')", "__import__('os')"), ("[" * 99999 + "]" * 99999, "[" * 99999 + "]" * 99999),
])
def test_glm_typed_value_never_evaluates(text: str, value: Any) -> None:
    assert typed_value(text) == value


def test_pythonic_content_streams_at_once_unless_it_starts_a_list() -> None:
    parser = PythonicToolCallParser()
    assert parser.feed("Hello [x]").content == "Hello [x]"
    held = PythonicToolCallParser()
    assert not held.feed("[get_time(")
    delta = held.feed(")]")
    assert not delta and held.flush().tool_calls[0].name == "get_time"
