"""Every bad input is a 4xx in the route's own protocol, naming the field; nothing is ever a 500."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import MESSAGES, assert_anthropic_error, assert_openai_error

CHAT = {"messages": MESSAGES, "max_tokens": 4}
COMPLETION = {"prompt": "hello", "max_tokens": 4}

CHAT_ERRORS = [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),  # OpenAI's range is 0 to 2 (GenerationConfig's reaches 10,000)
    ({"top_p": 1.5}, "top_p"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"n": 100000}, "n"),
    ({"n": "3"}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"top_p": -0.5}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 10, "max_tokens": 2}, "min_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tokens": 100000}, "max_tokens"),
    # past int64, or outside the vocabulary: validated up front, never a failed batch step
    ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [999999], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {str(2**70): 1}}, "logit_bias"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"min_tokens": 2**70}, "min_tokens"),
    ({"n": 2**70}, "n"),
    ({"top_logprobs": 2**70, "logprobs": True}, "top_logprobs"),
    # broken tool definitions
    ({"tools": [{}]}, "tools[0].type"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    # a function name OpenAI refuses (^[a-zA-Z0-9_-]{1,64}$): it was rendered into the prompt as it came
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "weather.get"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice"),  # a function that is not an object: it was a 500
    # a json_schema response format needs a name as OpenAI's (^[a-zA-Z0-9_-]{1,64}$): it was not read at all
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a reply", "schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    # audio output, which a text model cannot give: it was ignored, so the client found no message.audio
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    # the removed interactive-state fields are rejected by name
    ({"sequence_start": True}, "sequence_start"),
    ({"sequence_end": True}, "sequence_end"),
    ({"step": 3}, "step"),
    ({"interactive_mode": True}, "interactive_mode"),
]

COMPLETION_ERRORS = [
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),  # was a 200 of one token (a fuzz of field values found it)
    ({"max_tokens": -5, "echo": True}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [999999], "min_tokens": 1}, "stop_token_ids"),
    ({"seed": 2**70}, "seed"),
    ({"logprobs": 2**70}, "logprobs"),
    ({"sequence_start": True}, "sequence_start"),
    ({"interactive_mode": False}, "interactive_mode"),
]


@pytest.mark.parametrize(("change", "param"), CHAT_ERRORS, ids=[p for _, p in CHAT_ERRORS])
def test_chat_validation_names_the_field(http: httpx.Client, change: dict, param: str):
    assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, param)


@pytest.mark.parametrize(("change", "param"), COMPLETION_ERRORS, ids=[p for _, p in COMPLETION_ERRORS])
def test_completion_validation_names_the_field(http: httpx.Client, change: dict, param: str):
    assert_openai_error(http.post("/v1/completions", json={**COMPLETION, **change}), 400, param)


def test_prompt_longer_than_the_context_window_says_so(http: httpx.Client, model_card: dict):
    window = model_card["max_model_len"]
    text = "x" * window  # at least `window` tokens (one per character for these tokenizers: checked)
    assert http.post("/tokenize", json={"prompt": text}).json()["count"] >= window
    token = http.post("/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()["tokens"]
    for body in ({"prompt": text}, {"prompt": token * window}, {"prompt": ["ok", text]}):
        error = assert_openai_error(http.post("/v1/completions", json=body), 400, "prompt")
        assert "context window" in error["message"] and str(window) in error["message"]
    chat = {"messages": [{"role": "user", "content": text}]}
    # the field a chat request has, as OpenAI names it (it was "prompt", which a chat request has not)
    error = assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, "messages")
    assert "context window" in error["message"]
    assert error["code"] == "context_length_exceeded"  # what OpenAI clients check to truncate
    error = assert_openai_error(http.post("/v1/responses", json={"input": text}), 400, "input")
    assert "context window" in error["message"] and error["code"] == "context_length_exceeded"
    error = assert_anthropic_error(http.post("/v1/messages", json={**chat, "max_tokens": 4}), 400)
    assert "context window" in error["message"]
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": window}), 400,
                                "max_tokens")
    assert "context window" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/abort"])
@pytest.mark.parametrize("body", [b"{bad json", b"[1, 2]", b"", b"null", b"\xff\xfe", b'{"prompt": {"a": 1}}'])
def test_malformed_bodies_are_400_not_500(http: httpx.Client, path: str, body: bytes):
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)


def test_unknown_model_is_404(http: httpx.Client):
    error = assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model")
    assert "nope" in error["message"]
    assert_anthropic_error(http.post("/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": MESSAGES}), 404)


@pytest.mark.parametrize(("body", "needle"), [
    ({"messages": MESSAGES}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": "4"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "text"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "role"),
    ({"messages": MESSAGES, "max_tokens": 4, "temperature": -2}, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 4, "top_k": 2**70}, "top_k"),
    ({"messages": MESSAGES, "max_tokens": 2**70}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 4, "tools": [{}]}, "tools.0.name"),
    ({"messages": MESSAGES, "max_tokens": 4, "tools": [{"name": 5, "input_schema": {}}]}, "tools.0.name"),
    ({"messages": MESSAGES, "max_tokens": 4, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"messages": MESSAGES, "max_tokens": 4, "tools": [{"name": "f", "input_schema": "x"}]}, "tools.0.input_schema"),
    ({"messages": MESSAGES, "max_tokens": 4, "sequence_start": True}, "sequence_start"),
    ({"messages": MESSAGES, "max_tokens": 4, "interactive_mode": True}, "interactive_mode"),
])
def test_anthropic_validation_errors_use_its_shape(http: httpx.Client, body: dict, needle: str):
    error = assert_anthropic_error(http.post("/v1/messages", json=body), 400)
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def test_anthropic_image_errors_name_the_clients_message_index(http: httpx.Client):
    """A top-level system prompt is no message of the client's: it must not shift the indices."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bad"}}
    body = {"system": "Be brief.", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]}
    error = assert_anthropic_error(http.post("/v1/messages", json=body), 400)
    assert "messages[0].content[1]" in error["message"] and "messages[1]" not in error["message"]
    for system in ("Be brief.", None):
        count = http.post("/v1/messages/count_tokens", json={**body, "system": system})
        assert "messages[0].content[1]" in assert_anthropic_error(count, 400)["message"]


def test_tokenize_checks_tools_and_removed_fields(http: httpx.Client):
    tokenize = {"messages": MESSAGES}
    assert_openai_error(http.post("/tokenize", json={**tokenize, "tools": [{}]}), 400, "tools[0].type")
    assert_openai_error(http.post("/tokenize", json={**tokenize, "step": 1}), 400, "step")


def test_unknown_route_and_method_keep_the_protocol_shape(http: httpx.Client):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/chat/completions"), 405)
    assert_anthropic_error(http.get("/v1/messages"), 405)


def test_the_server_keeps_serving_after_bad_input(http: httpx.Client):
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
