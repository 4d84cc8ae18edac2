"""Tools and reasoning end to end: `core serve` parses the model's text into tool_calls, reasoning_content,
Anthropic tool_use and thinking blocks, streamed and whole, for the official openai client and over HTTP.

The model is the "scripted" backend (scripted_backend_plugin.py): a random-weight model cannot be made to
emit a tool call or a <think> block, so this fake replies with exactly the text its prompt scripts, and the
test chooses the model output that the real template, engine, server and parsers then process. Two servers:
a Qwen2.5-style model (its real template) started with `--tool-call-parser hermes`, and a Qwen3-style model
started with no parser flags, whose parsers (qwen3 + hermes) are chosen by architecture and template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import HERE, ServerSpec, run_server
from scripted_backend_plugin import say

from core.testing.parse import parse_sse

pytest.importorskip("core_templates")

QWEN25_TEMPLATE = HERE.parents[1] / "plugins" / "templates" / "tests" / "data" / "qwen2.5.jinja"
ENV = {"CORE_PLUGINS": "templates", "CORE_EXTRA_PLUGINS": "scripted_backend_plugin"}
QWEN25 = ServerSpec("qwen2.5-hermes", backend="scripted", args=("--tool-call-parser", "hermes"),
                    env={**ENV, "CORE_SCRIPTED_ARCHITECTURE": "Qwen2ForCausalLM",
                         "CORE_SCRIPTED_TEMPLATE": str(QWEN25_TEMPLATE)})
QWEN3_AUTO = ServerSpec("qwen3-auto", backend="scripted", env={**ENV, "CORE_SCRIPTED_ARCHITECTURE": "Qwen3ForCausalLM"})

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
THINK_CALL = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL


def ask(script: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "What is the weather in Paris? " + say(script)}]


def _openai_client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def qwen25() -> Iterator[Any]:
    with run_server(QWEN25) as server:
        yield server


@pytest.fixture(scope="module")
def qwen3() -> Iterator[Any]:
    with run_server(QWEN3_AUTO) as server:
        yield server


@pytest.fixture
def hermes_client(qwen25: Any) -> Iterator[openai.OpenAI]:
    yield from _openai_client(qwen25)


@pytest.fixture
def auto_client(qwen3: Any) -> Iterator[openai.OpenAI]:
    yield from _openai_client(qwen3)


def _chat(client: openai.OpenAI, script: str, **options: Any) -> Any:
    return client.chat.completions.create(model="scripted", messages=ask(script), **options)


def _stream(client: openai.OpenAI, script: str, **options: Any) -> list[Any]:
    return list(_chat(client, script, stream=True, **options))


def _calls(tool_calls: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or ()]


# -- OpenAI, --tool-call-parser hermes -------------------------------------------------------------


def test_tool_call_comes_back_parsed(hermes_client: openai.OpenAI):
    choice = _chat(hermes_client, CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert _calls([call]) == [("get_weather", {"city": "Paris"})]


def test_streamed_tool_call_sends_name_first_then_arguments(hermes_client: openai.OpenAI):
    chunks = _stream(hermes_client, CALL, tools=TOOLS)
    entries = [e for c in chunks for ch in c.choices for e in ch.delta.tool_calls or ()]
    first, rest = entries[0], entries[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(e.index == 0 and e.id is None and e.function.name is None for e in rest)
    assert json.loads("".join(e.function.arguments for e in rest)) == {"city": "Paris"}
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)


def test_the_clients_stream_helper_assembles_the_same_message(hermes_client: openai.OpenAI):
    whole = _chat(hermes_client, TWO_CALLS, tools=TOOLS).choices[0]
    with hermes_client.chat.completions.stream(model="scripted", messages=ask(TWO_CALLS), tools=TOOLS) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert whole.message.content == streamed.message.content == "Let me check both."
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert _calls(whole.message.tool_calls) == _calls(streamed.message.tool_calls) == expected
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(hermes_client: openai.OpenAI, stream: bool):
    """As vLLM does: the model may write several calls, the response carries the first."""
    options = {"tools": TOOLS, "parallel_tool_calls": False}
    if stream:
        chunks = _stream(hermes_client, TWO_CALLS, **options)
        entries = [e for c in chunks for ch in c.choices for e in ch.delta.tool_calls or ()]
        assert {e.index for e in entries} == {0} and [e.function.name for e in entries if e.function.name] == [
            "get_weather"]
        assert json.loads("".join(e.function.arguments or "" for e in entries)) == {"city": "Paris"}
        content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    else:
        choice = _chat(hermes_client, TWO_CALLS, **options).choices[0]
        assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
        content, finish = choice.message.content, [choice.finish_reason]
    assert content == "Let me check both." and finish == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_call_is_plain_content(hermes_client: openai.OpenAI, stream: bool):
    if stream:
        chunks = _stream(hermes_client, MALFORMED, tools=TOOLS)
        content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        assert not any(ch.delta.tool_calls for c in chunks for ch in c.choices)
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    else:
        choice = _chat(hermes_client, MALFORMED, tools=TOOLS).choices[0]
        content, finish = choice.message.content, [choice.finish_reason]
        assert not choice.message.tool_calls
    assert content == MALFORMED and finish == ["stop"]


@pytest.mark.parametrize("options", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no tools", "choice none"])
def test_no_tool_parsing_without_tools(hermes_client: openai.OpenAI, options: dict[str, Any]):
    choice = _chat(hermes_client, CALL, **options).choices[0]
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tool_result_renders_in_the_next_request(hermes_client: openai.OpenAI, qwen25: Any):
    call = _chat(hermes_client, CALL, tools=TOOLS).choices[0].message
    messages = [*ask(CALL), call.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                 "content": '{"temperature": 21}' + say("It is 21 degrees in Paris.")}]
    answer = hermes_client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS).choices[0]
    assert answer.message.content == "It is 21 degrees in Paris." and answer.finish_reason == "stop"
    tokens = httpx.post(qwen25.url("/tokenize"), json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(qwen25.url("/detokenize"), json={"tokens": tokens}).json()["prompt"]
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}' in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# -- OpenAI, parsers chosen automatically (Qwen3) --------------------------------------------------


def test_reasoning_content_is_split_from_content(auto_client: openai.OpenAI):
    message = _chat(auto_client, "<think>\nParis is in France.\n</think>\n\nIt is sunny.").choices[0].message
    assert message.reasoning_content == "Paris is in France." and message.content == "It is sunny."


def test_automatic_parsers_stream_reasoning_then_tool_call(auto_client: openai.OpenAI):
    chunks = _stream(auto_client, THINK_CALL, tools=TOOLS)
    deltas = [ch.delta for c in chunks for ch in c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    entries = [e for d in deltas for e in d.tool_calls or ()]
    assert reasoning == "The user wants the weather."
    assert entries[0].function.name == "get_weather"
    assert json.loads("".join(e.function.arguments or "" for e in entries)) == {"city": "Paris"}
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    whole = _chat(auto_client, THINK_CALL, tools=TOOLS).choices[0]
    assert whole.message.reasoning_content == reasoning and whole.finish_reason == "tool_calls"
    assert _calls(whole.message.tool_calls) == [("get_weather", {"city": "Paris"})]


def test_thinking_disabled_keeps_everything_content(auto_client: openai.OpenAI):
    script = "<think>\nno\n</think>\n\nyes"
    message = _chat(auto_client, script, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == script and getattr(message, "reasoning_content", None) is None


def test_n_choices_are_parsed_independently(auto_client: openai.OpenAI):
    chunks = _stream(auto_client, THINK_CALL, tools=TOOLS, n=2)
    for index in (0, 1):
        entries = [e for c in chunks for ch in c.choices if ch.index == index for e in ch.delta.tool_calls or ()]
        assert [e.index for e in entries][0] == 0 and entries[0].function.name == "get_weather"
        assert json.loads("".join(e.function.arguments for e in entries)) == {"city": "Paris"}


# -- Anthropic --------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def _anthropic_body(script: str, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": 200, "tools": ANTHROPIC_TOOLS, "messages": ask(script), **extra}


def test_anthropic_tool_use_and_thinking_blocks(qwen3: Any):
    message = httpx.post(qwen3.url("/v1/messages"), json=_anthropic_body(THINK_CALL)).json()
    assert message["stop_reason"] == "tool_use"
    thinking, tool_use = message["content"]
    assert thinking == {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""}
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "get_weather"
    assert tool_use["input"] == {"city": "Paris"} and tool_use["id"]


def test_anthropic_stream_uses_its_block_events(qwen3: Any):
    response = httpx.post(qwen3.url("/v1/messages"), json=_anthropic_body(THINK_CALL, stream=True))
    events = [(name, json.loads(data)) for name, data in parse_sse(response.text)]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta") == \
        "The user wants the weather."
    arguments = "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
    assert json.loads(arguments) == {"city": "Paris"}
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1]
    assert next(d for n, d in events if n == "message_delta")["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_disable_parallel_tool_use_keeps_the_first_call(qwen3: Any, stream: bool):
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    body = _anthropic_body(TWO_CALLS, tool_choice=choice, stream=stream)
    response = httpx.post(qwen3.url("/v1/messages"), json=body)
    if stream:
        events = [json.loads(data) for _, data in parse_sse(response.text)]
        blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    else:
        blocks = response.json()["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"]


def test_responses_parallel_tool_calls_false_keeps_the_first_call(qwen3: Any):
    body = {"input": ask(TWO_CALLS), "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "parallel_tool_calls": False}
    output = httpx.post(qwen3.url("/v1/responses"), json=body).json()["output"]
    assert [(item["type"], item.get("arguments")) for item in output] == [
        ("message", None), ("function_call", '{"city": "Paris"}')]


def test_anthropic_tool_result_renders_like_openai_tool_messages(qwen3: Any):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C" + say("Sunny, 21 degrees.")}]},
    ]
    message = httpx.post(qwen3.url("/v1/messages"), json={"max_tokens": 50, "tools": ANTHROPIC_TOOLS,
                                                          "messages": history}).json()
    assert message["content"] == [{"type": "text", "text": "Sunny, 21 degrees."}]
    assert message["stop_reason"] == "end_turn"
    openai_history = [history[0],
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                      {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C" + say("Sunny, 21 degrees.")}]
    tokens = httpx.post(qwen3.url("/tokenize"), json={"messages": openai_history, "tools": TOOLS}).json()["tokens"]
    assert message["usage"]["input_tokens"] == len(tokens)
    prompt = httpx.post(qwen3.url("/detokenize"), json={"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\n21 C" in prompt and '"name": "get_weather"' in prompt


# -- start-up --------------------------------------------------------------------------------------


def test_unknown_parser_name_fails_at_start_up_listing_the_registered_ones():
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--backend", "scripted", "--port", "1",
                             "--tool-call-parser", "hermes2"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith("core serve: error: --tool-call-parser 'hermes2' is not a registered tool-call parser")
    assert all(name in line for name in ("hermes", "llama3_json", "mistral", "qwen3_coder", "'none'"))
