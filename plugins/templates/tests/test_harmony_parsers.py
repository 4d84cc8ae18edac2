"""gpt-oss's Harmony format: reasoning ("openai_gptoss") and tool calls ("openai"), alone and chained as the
server chains them, whole and streamed at every cut of the text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.detokenize import IncrementalDetokenizer
from core.parsers import ParseContext
from core.testing.parsers import collect_tool_calls
from core_templates.parsers.harmony import HarmonyReasoningParser, HarmonyToolCallParser, parse_header

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>User wants the weather. Use get_weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny ☀ in Paris."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "days": 2}')
CALL_IN_ROLE = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking two things…<|end|>"
BROWSE = '<|start|>assistant<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}'
PARIS = {"city": "Paris", "days": 2}

# model text -> (reasoning, content, [(name, arguments object)]) once both parsers ran, as the server runs them
CASES: list[tuple[str, str | None, str, list[tuple[str, dict[str, Any]]]]] = [
    (ANALYSIS + FINAL, "User wants the weather. Use get_weather.", "It is sunny ☀ in Paris.", []),
    (ANALYSIS + FINAL + "<|return|>", "User wants the weather. Use get_weather.", "It is sunny ☀ in Paris.", []),
    (ANALYSIS + CALL, "User wants the weather. Use get_weather.", "", [("get_weather", PARIS)]),
    (ANALYSIS + CALL + "<|call|>", "User wants the weather. Use get_weather.", "", [("get_weather", PARIS)]),
    (ANALYSIS + PREAMBLE + CALL + "<|call|>" + CALL_IN_ROLE, "User wants the weather. Use get_weather.",
     "Checking two things…", [("get_weather", PARIS), ("get_time", {})]),
    (CALL[len("<|start|>assistant"):], None, "", [("get_weather", PARIS)]),  # no analysis: the call opens it
    (CALL_IN_ROLE[len("<|start|>assistant"):], None, "", [("get_time", {})]),
    (ANALYSIS + BROWSE + "<|call|><|start|>assistant" + ANALYSIS + FINAL,
     'User wants the weather. Use get_weather.\n{"query": "x"}\nUser wants the weather. Use get_weather.',
     "It is sunny ☀ in Paris.", []),
    (ANALYSIS + CALL.replace('2}', '2'), "User wants the weather. Use get_weather.",
     CALL.replace('2}', '2') + "<|call|>", []),  # cut off mid-arguments: kept as written
    (ANALYSIS + CALL.replace("functions.get_weather", "functions."), "User wants the weather. Use get_weather.",
     CALL.replace("functions.get_weather", "functions.") + "<|call|>", []),  # no function name: as written
    ("<|channel|>final<|message|>Hi<|return|>", None, "Hi", []),
    ("<|channel|>analysis<|message|>Still thinking ü", "Still thinking ü", "", []),
    ("analysisUser wants the weather.assistantfinalSunny.", None,
     "analysisUser wants the weather.assistantfinalSunny.", []),  # special tokens stripped: plain content
    ("<|channel|>analysis<|end|>Hi", None, "<|channel|>analysis<|end|>Hi", []),  # a header that never ends
    ("", None, "", []),
]


def cuts(text: str) -> list[list[str]]:
    """The text cut in two at every boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def calls_of(parsed: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def context() -> ParseContext:
    return ParseContext(PROMPT, tools=[{"type": "function", "function": {"name": "get_weather"}}])


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_response(text: str, reasoning: str | None, content: str, calls: list[Any]) -> None:
    split_reasoning, rest = HarmonyReasoningParser().start(context()).split(text)
    parsed = HarmonyToolCallParser().start(context()).parse(rest)
    assert (split_reasoning, parsed.content, calls_of(parsed)) == (reasoning, content, calls)
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_streaming_matches_at_every_cut(text: str, reasoning: str | None, content: str, calls: list[Any]) -> None:
    for pieces in cuts(text):
        reasoner, tools = HarmonyReasoningParser().start(context()), HarmonyToolCallParser().start(context())
        splits = [reasoner.feed(piece) for piece in pieces] + [reasoner.flush()]
        deltas = [tools.feed(split.content) for split in splits] + [tools.flush()]
        collected = collect_tool_calls(deltas)
        assert "".join(s.reasoning for s in splits) == (reasoning or ""), pieces
        assert (collected.content, calls_of(collected)) == (content, calls), pieces


@pytest.mark.parametrize("text", [text for text, *_ in CASES])
def test_the_tool_parser_alone_reads_a_whole_response(text: str) -> None:
    """Without the reasoning parser, every message but a call stays content as written."""
    whole = HarmonyToolCallParser().parse(text)
    for pieces in cuts(text):
        parser = HarmonyToolCallParser()
        collected = collect_tool_calls([parser.feed(piece) for piece in pieces] + [parser.flush()])
        assert (collected.content, calls_of(collected)) == (whole.content, calls_of(whole)), pieces


def test_the_tool_parser_alone_keeps_other_messages_as_written() -> None:
    parsed = HarmonyToolCallParser().parse(ANALYSIS + CALL + "<|call|>")
    assert parsed.content == ANALYSIS and calls_of(parsed) == [("get_weather", PARIS)]


def test_reasoning_and_content_stream_without_waiting_for_the_end() -> None:
    parser = HarmonyReasoningParser().start(context())
    assert parser.feed("<|channel|>analysis<|message|>Hm").reasoning == "Hm"
    assert parser.feed("m<|en").reasoning == "m"
    delta = parser.feed("d|><|start|>assistant<|channel|>final<|message|>Sun")
    assert (delta.reasoning, delta.content) == ("", "Sun")
    assert parser.feed("ny").content == "ny" and not parser.flush()


@pytest.mark.parametrize(("header", "channel", "recipient"), [
    ("<|channel|>analysis", "analysis", None),
    ("assistant<|channel|>commentary to=functions.f <|constrain|>json", "commentary", "functions.f"),
    ("assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f"),
    ("<|channel|>commentary to=functions.f<|constrain|>json", "commentary", "functions.f"),
    ("assistant", None, None),
])
def test_headers(header: str, channel: str | None, recipient: str | None) -> None:
    parsed = parse_header(header)
    assert (parsed.channel, parsed.recipient) == (channel, recipient)


def test_a_constraint_waits_for_the_final_channel() -> None:
    parser = HarmonyReasoningParser().start(context())
    assert parser.reasoning_end == "<|channel|>final<|message|>" and parser.constraint_waits()
    assert HarmonyReasoningParser.reads_special_tokens and HarmonyToolCallParser.reads_special_tokens


def harmony_tokenizer() -> Any:
    """A byte-level tokenizer whose special tokens are Harmony's markers, as gpt-oss's are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    markers = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.add_special_tokens({"additional_special_tokens": markers})
    return fast


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_what_the_server_decodes(skip_special_tokens: bool) -> None:
    """Token by token through the server's detokenizer: with the special tokens kept the response parses;
    skipped (the server's default), the markers are gone and all of it is content."""
    tokenizer = harmony_tokenizer()
    text = ANALYSIS + PREAMBLE + CALL
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT, add_special_tokens=False),
                                         skip_special_tokens=skip_special_tokens)
    reasoner, tools = HarmonyReasoningParser().start(context()), HarmonyToolCallParser().start(context())
    pieces = [detokenizer.update([i]).text for i in tokenizer.encode(text, add_special_tokens=False)]
    splits = [reasoner.feed(piece) for piece in pieces + [detokenizer.update([], final=True).text]]
    splits.append(reasoner.flush())
    collected = collect_tool_calls([tools.feed(split.content) for split in splits] + [tools.flush()])
    reasoning = "".join(split.reasoning for split in splits)
    if skip_special_tokens:
        assert (reasoning, collected.tool_calls) == ("", ()) and "analysisUser wants" in collected.content
    else:
        assert (reasoning, collected.content) == ("User wants the weather. Use get_weather.", "Checking two things…")
        assert calls_of(collected) == [("get_weather", PARIS)]
