"""Defects the fuzz suite (test_fuzz.py) found, each pinned by a test that failed before its fix."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import RunningServer
from server_helpers import assert_anthropic_error, assert_openai_error

RAISING = [{"role": "user", "content": "RAISE_IN_RENDER"}]


def _exchange(sock: socket.socket, path: str, body: dict) -> bytes:
    """One HTTP/1.1 request on a kept-alive socket; the raw response ("" when the server closed)."""
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            return head
        head += chunk
    header, _, rest = head.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return header + b"\r\n\r\n" + rest


def test_a_500_keeps_the_connection_open(server: RunningServer) -> None:
    """After an unexpected error the server answered 500, then closed the keep-alive connection (uvicorn
    does when the app re-raises), so a client's next request on it met a connection reset."""
    if not server.spec.is_fake:
        pytest.skip("the failure is injected by the fake server's chat template")
    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        first = _exchange(sock, "/v1/chat/completions", {"messages": RAISING})
        assert first.startswith(b"HTTP/1.1 500"), first[:200]
        assert b"secret internals" not in first
        second = _exchange(sock, "/v1/models", {})
        assert second.startswith(b"HTTP/1.1 405") or second.startswith(b"HTTP/1.1 200"), second[:200]


def test_a_500_in_each_protocol(server: RunningServer, http: httpx.Client) -> None:
    if not server.spec.is_fake:
        pytest.skip("the failure is injected by the fake server's chat template")
    error = assert_openai_error(http.post("/v1/chat/completions", json={"messages": RAISING}), 500)
    assert "secret" not in error["message"]
    body = {"messages": RAISING, "max_tokens": 4}
    assert "secret" not in assert_anthropic_error(http.post("/v1/messages", json=body), 500)["message"]


@pytest.mark.parametrize(("content", "param"), [
    ({"a": 1}, "messages[0].content"),
    (5, "messages[0].content"),
    ([5], "messages[0].content[0]"),
    ([{"type": {}}], "messages[0].content[0]"),  # was a 500 (an unhashable type in the content-format step)
    ([{"text": "no type"}], "messages[0].content[0]"),
    ([{"type": "text", "text": {"x": 1}}], "messages[0].content[0].text"),  # was a 500 on the fake template
])
def test_malformed_content_is_a_400_naming_it(http: httpx.Client, content, param: str) -> None:
    """Message content was not checked: a number or an object rendered as junk (200), a part whose type or
    text was no string crashed the template step (500)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert_openai_error(http.post("/tokenize", json={"messages": body["messages"]}), 400, param=param)


@pytest.mark.parametrize(("change", "param"), [
    ({"tool_calls": "x"}, "messages[1].tool_calls"),
    ({"tool_calls": [{"id": "1"}]}, "messages[1].tool_calls[0].function.name"),
    ({"tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"name": 5}, "messages[1].name"),
])
def test_malformed_assistant_fields_are_a_400_naming_them(http: httpx.Client, change: dict, param: str) -> None:
    """tool_calls and name were not checked: whatever was sent reached the template (a 200 on templates
    that do not render them)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, **change},
                {"role": "user", "content": "and?"}]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}), 400, param)


def test_a_nested_non_object_names_its_field(http: httpx.Client) -> None:
    """A message that is no object was reported as "the request body must be a JSON object"."""
    error = assert_anthropic_error(http.post("/v1/messages", json={"messages": [5], "max_tokens": 2}), 400)
    assert error["message"].startswith("messages.0:"), error
    error = assert_openai_error(http.post("/v1/completions", json=[1, 2]), 400, param="body")
    assert "JSON object" in error["message"]
