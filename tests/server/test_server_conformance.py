"""Every response body and streamed event, validated against the official clients' own typed models.

The clients build their objects without validation, so a field they declare required, a value outside a
Literal or a wrong type goes unnoticed until a typed caller reads it. Here the raw JSON of each route is
validated strictly (`model_validate`) against openai.types and anthropic.types.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_helpers import MESSAGES

from core.testing.parse import parse_sse

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)


def streamed(http: httpx.Client, path: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> list[Any]:
    """The JSON payloads of a streamed response (without OpenAI's closing [DONE])."""
    response = http.post(path, json={**body, "stream": True}, headers=headers)
    assert response.status_code == 200, response.text
    return [json.loads(data) for _, data in parse_sse(response.text) if data != "[DONE]"]


def test_whole_responses_validate_as_the_clients_types(http: httpx.Client, model: str):
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "logprobs": True,
                                                   "top_logprobs": 2, "n": 2})
    ChatCompletion.model_validate(chat.json())
    Completion.model_validate(http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}).json())
    Response.model_validate(http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4}).json())
    message = http.post("/v1/messages", json={"model": model, "messages": MESSAGES, "max_tokens": 4},
                        headers=ANTHROPIC_HEADERS)
    Message.model_validate(message.json())


def test_streamed_events_validate_as_the_clients_types(http: httpx.Client, model: str):
    chunks = streamed(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                                                     "stream_options": {"include_usage": True}})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    events = streamed(http, "/v1/responses", {"input": "Hi", "max_output_tokens": 4})
    for event in events:
        RESPONSE_EVENT.validate_python(event)
    Response.model_validate(events[-1]["response"])
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    events = streamed(http, "/v1/messages", body, ANTHROPIC_HEADERS)
    for event in events:
        if event["type"] != "ping":  # the client skips pings, so its union has no type for them
            ANTHROPIC_EVENT.validate_python(event)


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(http: httpx.Client, n: int):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed so far."""
    body = {"messages": MESSAGES, "max_tokens": 5, "n": n, "temperature": 1.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = streamed(http, "/v1/chat/completions", body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * n
    assert all(c.get("usage") is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}
    for c in chunks:
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]


def test_continuous_usage_stats_of_a_completion_list(http: httpx.Client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = streamed(http, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3, "stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6 and chunks[-1]["choices"] == []


def test_continuous_usage_stats_without_include_usage_add_nothing(http: httpx.Client):
    chunks = streamed(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3,
                                                     "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"]


# Fields of the client's create() that change nothing here (as in vLLM, which ignores them too): who asked
# (user, safety_identifier), bookkeeping (metadata, store false, prompt_cache_key), latency hints (service_tier,
# prediction), and text output (modalities ["text"]).
IGNORED = {"user": "u1", "safety_identifier": "s1", "metadata": {"k": "v"}, "store": False, "prompt_cache_key": "p",
           "service_tier": "auto", "prediction": {"type": "content", "content": "Hello"}, "modalities": ["text"],
           "verbosity": "low", "web_search_options": {}}


def test_fields_that_change_nothing_are_accepted(client, model: str):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0.0)
    ignored = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0.0,
                                             **IGNORED)
    assert ignored.choices[0].message.content == plain.choices[0].message.content


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                             b'"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": 1}}'),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x " * 5000}]}).encode()),
    ("/v1/completions", b'{"prompt": [-1]}'),
    ("/v1/responses", b'{"input": [{"role": "user", "content": 5}]}'),
    ("/v1/messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}'),
]


def test_bad_requests_do_not_disturb_a_concurrent_stream(http: httpx.Client, server):
    """Bad requests sent while a greedy stream runs are 4xx each, and the stream's text is the one it gives alone."""
    body = {"messages": MESSAGES, "max_tokens": 64, "temperature": 0.0}
    alone = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    def bad(request: tuple[str, bytes]) -> int:
        with httpx.Client(base_url=server.base_url, timeout=30.0) as other:
            return other.post(request[0], content=request[1], headers={"content-type": "application/json"}).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool, \
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        statuses = list(pool.map(bad, BAD_REQUESTS * 3))
        rest = list(lines)
    assert all(400 <= status < 500 for status in statuses), statuses
    chunks = [json.loads(line[5:]) for line in [first, *rest] if line.startswith("data:") and "[DONE]" not in line]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == alone
    assert not any("error" in c for c in chunks)
