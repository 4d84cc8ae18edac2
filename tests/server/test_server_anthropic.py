"""Anthropic Messages: whole and streamed responses, stop reasons, count_tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MESSAGES, abort_while_running, assert_anthropic_error

from core.testing.parse import parse_sse

BODY = {"max_tokens": 8, "temperature": 0.0, "messages": MESSAGES, "system": "Be brief."}
EVENTS = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop"]  # the order of Anthropic's own streams


def test_non_stream_message(http: httpx.Client, model: str):
    response = http.post("/v1/messages", json={**BODY, "model": model, "metadata": {"user_id": "u1"}})
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == model
    assert message["content"][0]["type"] == "text" and message["content"][0]["text"]
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    assert message["usage"]["output_tokens"] == 8
    count = http.post("/v1/messages/count_tokens", json={"messages": MESSAGES, "system": "Be brief."}).json()
    assert message["usage"]["input_tokens"] == count["input_tokens"] > 0


def test_stream_event_sequence_matches_the_whole_message(http: httpx.Client):
    whole = http.post("/v1/messages", json=BODY).json()
    response = http.post("/v1/messages", json={**BODY, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [(name, json.loads(data)) for name, data in parse_sse(response.text)]
    names = [name for name, _ in events]
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert collapsed == EVENTS
    assert all(data["type"] == name for name, data in events) and names.count("ping") == 1
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_stop_sequences_report_stop_sequence(http: httpx.Client):
    text = http.post("/v1/messages", json=BODY).json()["content"][0]["text"]
    sequence = text[2:4]
    message = http.post("/v1/messages", json={**BODY, "stop_sequences": [sequence]}).json()
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == sequence
    assert text.startswith(message["content"][0]["text"]) and sequence not in message["content"][0]["text"]


def test_system_as_blocks_equals_system_as_string(http: httpx.Client):
    blocks = {**BODY, "system": [{"type": "text", "text": "Be brief."}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]}
    assert http.post("/v1/messages", json=blocks).json()["content"] == http.post("/v1/messages", json=BODY).json()["content"]


def test_a_final_assistant_turn_is_a_prefill_the_response_continues(http: httpx.Client, model: str):
    """Anthropic's prefill: the conversation is rendered without a generation prompt, the template continuing
    the assistant's text (as OpenAI's add_generation_prompt false does), and only the continuation returns."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    continued = http.post("/tokenize", json={"model": model, "messages": prefill,
                                             "add_generation_prompt": False}).json()["count"]
    answered = http.post("/tokenize", json={"model": model, "messages": prefill}).json()["count"]
    assert continued != answered
    assert http.post("/v1/messages/count_tokens", json={"messages": prefill}).json()["input_tokens"] == continued
    message = http.post("/v1/messages", json={**BODY, "system": None, "messages": prefill}).json()
    assert message["usage"]["input_tokens"] == continued and message["content"][0]["text"]


def test_a_tool_round_trip(http: httpx.Client, model: str):
    """A turn of tool_use blocks only (content None once translated), then its tool_result (a "tool" message);
    the default model's template, which reads every message's content: test_server_structured_output.py."""
    body = {**BODY, "tools": [{"name": "w", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(("change", "param"), [
    ({"temperature": 1.5}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"top_p": 1.2}, "top_p"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
])
def test_values_outside_anthropics_ranges_are_a_400_naming_them(http: httpx.Client, change: dict, param: str):
    """Anthropic's API refuses a temperature or top_p outside 0-1 and a message of no content blocks; they were
    accepted (a temperature of 1.5 sampled as OpenAI's would)."""
    error = assert_anthropic_error(http.post("/v1/messages", json={**BODY, **change}), 400)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param), error


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "content": [{"type": "tool_use", "name": "w", "input": {}}]}, "messages.1.content.0.id"),
    ({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}, "messages.1.content.0.name"),
    ({"role": "assistant", "content": [{"type": "text"}]}, "messages.1.content.0.text"),
    ({"role": "user", "content": [{"type": "tool_result", "content": "sunny"}]}, "messages.1.content.0.tool_use_id"),
])
def test_a_block_without_its_required_field_is_a_400_naming_it(http: httpx.Client, message: dict, param: str):
    """A tool_use block without an id was refused as a block type "not supported (only text, tool_use and
    thinking)"."""
    body = {**BODY, "messages": [*MESSAGES, message, *([MESSAGES[0]] if message["role"] == "assistant" else [])]}
    error = assert_anthropic_error(http.post("/v1/messages", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param} is required"), error


def test_a_redacted_thinking_block_is_dropped(http: httpx.Client):
    """Its encrypted reasoning is for Anthropic's models alone; a conversation that carries one (from an earlier
    turn of another server) was a 400."""
    turns = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}, MESSAGES[0]]
    redacted = [*MESSAGES, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwKAhgB"},
                                                             {"type": "text", "text": "Hi."}]}, MESSAGES[0]]
    count = http.post("/v1/messages/count_tokens", json={"messages": redacted})
    assert count.status_code == 200, count.text
    assert count.json() == http.post("/v1/messages/count_tokens", json={"messages": turns}).json()
    assert http.post("/v1/messages", json={**BODY, "messages": redacted}).status_code == 200


def test_models_answer_anthropics_client_in_its_shape(server, model: str):
    """/v1/models is both APIs': to a request with an anthropic-version header (Anthropic's clients send one) it
    answers with Anthropic's ModelInfo and not-found error, which its client parses (it got OpenAI's objects,
    without display_name or created_at)."""
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0,
                             timeout=30.0) as client:
        [info] = [m for m in client.models.list().data if m.id == model]
        assert (info.type, info.display_name) == ("model", model) and info.created_at.year >= 2026
        assert client.models.retrieve(model).id == model
        with pytest.raises(anthropic.NotFoundError) as raised:
            client.models.retrieve("no-such-model")
    assert raised.value.body["error"]["type"] == "not_found_error"


@pytest.fixture
def anthropic_client(server):
    """The official Anthropic client pointed at the server."""
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0,
                             timeout=30.0) as client:
        yield client


def test_the_clients_stream_helper_gives_the_whole_messages_usage(anthropic_client, model: str):
    """message_delta carries the whole usage (the client's helper copies its input and cache counts onto the
    message): the cached prompt tokens were missing from a streamed message's usage."""
    create = {"model": model, "messages": [{"role": "user", "content": "A prompt of some tokens. " * 8}],
              "max_tokens": 3}
    anthropic_client.messages.create(**create)  # its blocks join the prefix cache
    with anthropic_client.messages.stream(**create) as stream:
        streamed = stream.get_final_message()
    whole = anthropic_client.messages.create(**create)
    assert streamed.usage.model_dump(exclude_none=True) == whole.usage.model_dump(exclude_none=True)


def test_adaptive_thinking_is_thinking_on(anthropic_client, model: str):
    """The client's thinking types include {"type": "adaptive"}: it was a 400 (only enabled and disabled were read)."""
    rendered = {kind: anthropic_client.messages.count_tokens(model=model, messages=MESSAGES, thinking=thinking)
                for kind, thinking in [("adaptive", {"type": "adaptive"}),
                                       ("enabled", {"type": "enabled", "budget_tokens": 1024})]}
    assert rendered["adaptive"].input_tokens == rendered["enabled"].input_tokens
    message = anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=4,
                                               thinking={"type": "adaptive"})
    assert message.usage.output_tokens == 4


@pytest.mark.parametrize(("thinking", "max_tokens"), [
    ({"type": "enabled"}, 2048), ({"type": "enabled", "budget_tokens": 1023}, 2048),
    ({"type": "enabled", "budget_tokens": "1024"}, 2048), ({"type": "enabled", "budget_tokens": 1024}, 1024),
])
def test_a_thinking_budget_outside_anthropics_rules_is_a_400(http: httpx.Client, thinking: dict, max_tokens: int):
    """budget_tokens is required, at least 1024 and below max_tokens in Anthropic's API; any value was accepted."""
    body = {**BODY, "max_tokens": max_tokens, "thinking": thinking}
    error = assert_anthropic_error(http.post("/v1/messages", json=body), 400)
    assert error["type"] == "invalid_request_error" and "thinking.budget_tokens" in error["message"], error
    if max_tokens > 1024:
        count = http.post("/v1/messages/count_tokens", json={"messages": MESSAGES, "thinking": thinking})
        assert "thinking.budget_tokens" in assert_anthropic_error(count, 400)["message"]


def test_an_aborted_message_is_paused_not_ended(http: httpx.Client, model: str, long_tokens: int):
    """An abort (/abort, a sleep, a shutdown's drain) cuts the turn short: Anthropic's stop reasons have no
    "aborted", and end_turn (vLLM's answer) told the client the model had finished. pause_turn says the turn
    stopped early and can be continued by sending the content back (a final assistant turn is a prefill)."""
    body = {**BODY, "model": model, "max_tokens": long_tokens}
    headers = {"X-Request-Id": "message-to-abort"}
    message = abort_while_running(http, lambda: http.post("/v1/messages", json=body, headers=headers).json(),
                                  "message-to-abort", running=1)
    assert message["stop_reason"] == "pause_turn" and message["stop_sequence"] is None
    assert message["usage"]["output_tokens"] < long_tokens
    events = abort_while_running(
        http, lambda: parse_sse(http.post("/v1/messages", json={**body, "stream": True}, headers=headers).text),
        "message-to-abort", running=1)
    delta = next(json.loads(data) for name, data in events if name == "message_delta")
    assert delta["delta"]["stop_reason"] == "pause_turn" and [name for name, _ in events][-1] == "message_stop"
