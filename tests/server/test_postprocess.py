"""The chat postprocessor: reasoning then tool-call parsing, whole and streamed cut at every boundary, and
its mapping onto OpenAI deltas and Anthropic content-block events. Uses the templates plugin's parsers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from core.backend import ModelInfo
from core.config import GenerationConfig
from core.engine import AsyncEngine
from core.errors import PluginError
from core.parsers import ParseContext, ReasoningParser
from core.plugins import load_plugins
from core.server import openai_translate as tr
from core.server.anthropic_stream import ContentBlockEvents
from core.server.postprocess import ChatPostprocessor, Postprocessors, StreamPiece
from core.testing.fake import EOS, ByteTokenizer, FakeBackend

pytest.importorskip("core_templates")
from core_templates.parsers.hermes import HermesToolCallParser  # noqa: E402
from core_templates.parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {
    "plain": "Just an answer, no tags.",
    "reasoning": "<think>\nLet me think.\n</think>\n\nThe answer.",
    "call": CALL,
    "reasoning and call": "<think>Weather needed.</think>\n" + CALL,
    "content and two calls": "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\nDone.",
    "malformed call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
    "unclosed think": "<think>still thinking",
    "tag-like text": "a < b and <tool and </think",
}


CONTEXT = ParseContext(tools=TOOLS)


def _postprocessor() -> ChatPostprocessor:
    return ChatPostprocessor(lambda: Qwen3ReasoningParser().start(CONTEXT),
                             lambda: HermesToolCallParser().start(CONTEXT))


def _collect(pieces: list[StreamPiece]) -> tuple[str | None, str, list[tuple[str, dict[str, Any]]]]:
    """(reasoning, content, calls) of streamed pieces, checking that each call starts before its arguments."""
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in pieces:
        if piece.kind == "tool_call":
            assert piece.index not in names and piece.id and piece.name
            names[piece.index] = piece.name
        elif piece.kind == "arguments":
            assert piece.index in names, "arguments before their call's name"
            arguments[piece.index] = arguments.get(piece.index, "") + piece.text
    calls = [(names[i], json.loads(arguments.get(i, "{}"))) for i in sorted(names)]
    return reasoning or None, "".join(p.text for p in pieces if p.kind == "content"), calls


def _whole(text: str) -> tuple[str | None, str, list[tuple[str, dict[str, Any]]]]:
    parts = _postprocessor().final(text)
    calls = [(c.name, json.loads(c.arguments)) for c in parts.tool_calls]
    return parts.reasoning_content or None, parts.content or "", calls


def _streamed(cuts: list[str]) -> tuple[tuple[str | None, str, list[tuple[str, dict[str, Any]]]], bool]:
    post = _postprocessor()
    pieces = [p for i, cut in enumerate(cuts) for p in post.delta(0, cut, finished=i == len(cuts) - 1)]
    return _collect(pieces), post.called_tools(0)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_two_way_cut_streams_like_the_whole_text(name: str):
    text = TEXTS[name]
    whole = _whole(text)
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]]) == (whole, bool(whole[2])), f"cut at {cut}: {text[:cut]!r}"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_character_by_character_streams_like_the_whole_text(name: str):
    text = TEXTS[name]
    assert _streamed(list(text) + [""]) == (_whole(text), bool(_whole(text)[2]))


def test_expected_splits():
    assert _whole(TEXTS["reasoning and call"]) == ("Weather needed.", "", [("get_weather", {"city": "Paris"})])
    assert _whole(TEXTS["content and two calls"])[1:] == (
        "Checking.Done.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})])
    assert _whole(TEXTS["malformed call"]) == (None, TEXTS["malformed call"], [])
    final = _postprocessor().final(CALL)
    assert final.content is None and final.tool_calls[0].id.startswith("call_")


def test_choices_keep_their_own_parser_state():
    post, text = _postprocessor(), TEXTS["reasoning and call"]
    pieces: dict[int, list[StreamPiece]] = {0: [], 1: []}
    for i, char in enumerate(text):  # interleaved, as the engine streams n > 1
        for choice in (0, 1):
            pieces[choice] += post.delta(choice, char, finished=i == len(text) - 1)
    assert _collect(pieces[0]) == _collect(pieces[1]) == _whole(text)


def test_without_parsers_everything_is_content():
    post = ChatPostprocessor()
    assert post.final(CALL).content == CALL and not post.final(CALL).tool_calls
    assert post.delta(0, "<think>x") == [StreamPiece("content", "<think>x")] and not post.called_tools(0)


class _Broken(ReasoningParser):
    def split(self, text: str) -> tuple[str | None, str]:
        raise RuntimeError("parser bug")

    feed = flush = split  # type: ignore[assignment]


def test_a_failing_parser_falls_back_to_plain_content():
    post = ChatPostprocessor(lambda: _Broken())
    assert post.final("some <think> text").content == "some <think> text"
    assert post.delta(0, "a") == [StreamPiece("content", "a")]
    assert post.delta(0, "b", finished=True) == [StreamPiece("content", "b")]


# -- choosing parsers for a served model -------------------------------------------------------------

QWEN3_SOURCE = "{{ messages }} <think> <tool_call>"


def _engine(architecture: str, template: str | None) -> AsyncEngine:
    info = ModelInfo(name="m", architecture=architecture, max_model_len=256, eos_token_ids=(EOS,),
                     chat_template=template, vocab_size=ByteTokenizer.vocab_size)
    return AsyncEngine(FakeBackend(model_info=info))


@pytest.fixture(scope="module")
def host() -> Any:
    return load_plugins(allow="templates", use_environment=False)


def _parses(post: ChatPostprocessor) -> tuple[bool, bool]:
    """(whether it splits reasoning, whether it parses tool calls)."""
    parts = post.final(TEXTS["reasoning and call"])
    return parts.reasoning_content is not None, bool(parts.tool_calls)


def test_automatic_choice_and_tools_only_with_tools(host: Any):
    choice = Postprocessors.choose(host, _engine("Qwen3ForCausalLM", QWEN3_SOURCE))
    assert (choice.reasoning, choice.tools) == (Qwen3ReasoningParser, HermesToolCallParser)
    assert _parses(choice.for_request("p", TOOLS)) == (True, True)
    assert _parses(choice.for_request("p", None)) == (True, False)
    assert _parses(choice.for_request("p", [])) == (True, False)


def test_none_turns_parsing_off(host: Any):
    choice = Postprocessors.choose(host, _engine("Qwen3ForCausalLM", QWEN3_SOURCE), "none", "none")
    assert (choice.reasoning, choice.tools) == (None, None)
    assert _parses(choice.for_request("p", TOOLS)) == (False, False)


def test_named_parsers_and_unknown_names(host: Any):
    engine = _engine("FakeForCausalLM", None)
    assert Postprocessors.choose(host, engine) == Postprocessors(None, None, engine.tokenizer)
    named = Postprocessors.choose(host, engine, "deepseek_r1", "hermes")
    assert (named.reasoning, named.tools) == (DeepSeekR1ReasoningParser, HermesToolCallParser)
    assert _parses(named.for_request("p", TOOLS)) == (True, True)
    with pytest.raises(PluginError, match="--reasoning-parser 'r2'.*deepseek_r1, glm45, lfm2, minimax_m1, nemotron_v3, openai_gptoss, qwen3"):
        Postprocessors.choose(host, engine, "r2")


def test_special_tokens_stay_where_a_parser_reads_them(host: Any):
    engine = _engine("FakeForCausalLM", None)
    prepared = asyncio.run(engine.prepare("Hi", GenerationConfig(max_new_tokens=1)))
    with_tools = dataclasses.replace(prepared, tools=TOOLS)
    harmony = Postprocessors.choose(host, engine, "openai_gptoss", "openai")
    assert harmony.prepare(prepared).config.skip_special_tokens is False
    tools_only = Postprocessors.choose(host, engine, "none", "openai")
    assert tools_only.prepare(prepared).config.skip_special_tokens is True  # no tools: no tool-call parser
    assert tools_only.prepare(with_tools).config.skip_special_tokens is False
    assert Postprocessors.choose(host, engine, "qwen3", "hermes").prepare(with_tools) == with_tools
    asyncio.run(engine.close())


def test_the_reasoning_parser_sees_the_prompt(host: Any):
    engine = _engine("FakeForCausalLM", None)
    post = Postprocessors.choose(host, engine, "qwen3").for_request("Q: hi\nA: <think>\n")
    assert post.final("deliberating</think>It is 4.").reasoning_content == "deliberating"
    plain = Postprocessors.choose(host, engine, "qwen3").for_request("Q: hi\nA: ")
    assert plain.final("deliberating</think>It is 4.").reasoning_content is None
    asyncio.run(engine.close())


# -- wire formats -------------------------------------------------------------------------------------

PIECES = [StreamPiece("reasoning", "a"), StreamPiece("reasoning", "b"), StreamPiece("content", "c"),
          StreamPiece("tool_call", index=0, id="call_1", name="f"), StreamPiece("arguments", '{"x": 1}', index=0),
          StreamPiece("tool_call", index=1, id="call_2", name="g"), StreamPiece("arguments", "{}", index=1)]


def test_openai_deltas():
    assert tr.chat_deltas(PIECES) == [
        {"reasoning_content": "ab"}, {"content": "c"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]


def _kinds(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    describe: dict[str, Callable[[dict[str, Any]], str]] = {
        "content_block_start": lambda d: f"start {d['index']} {d['content_block']['type']}",
        "content_block_delta": lambda d: f"delta {d['index']} {d['delta']['type']}",
        "content_block_stop": lambda d: f"stop {d['index']}",
    }
    return [describe[name](data) for name, data in events]


def test_anthropic_block_events():
    blocks = ContentBlockEvents()
    events = blocks.events(PIECES[:4]) + blocks.events(PIECES[4:]) + blocks.finish()
    assert _kinds(events) == [
        "start 0 thinking", "delta 0 thinking_delta", "delta 0 thinking_delta", "stop 0",
        "start 1 text", "delta 1 text_delta", "stop 1",
        "start 2 tool_use", "delta 2 input_json_delta", "stop 2",
        "start 3 tool_use", "delta 3 input_json_delta", "stop 3",
    ]
    assert events[7][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}


def test_anthropic_empty_message_has_one_empty_text_block():
    assert _kinds(ContentBlockEvents().finish()) == ["start 0 text", "stop 0"]


def test_anthropic_plain_text_block_opens_before_any_text():
    blocks = ContentBlockEvents()
    events = blocks.open_text() + blocks.events([StreamPiece("content", "hi")]) + blocks.finish()
    assert _kinds(events) == ["start 0 text", "delta 0 text_delta", "stop 0"]
