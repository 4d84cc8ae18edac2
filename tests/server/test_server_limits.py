"""Limits that keep one client from hurting the others: the request-size cap (413) and back-pressure
(503 with Retry-After) past --max-queued-requests, each in the route's own error shape."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import FAKE, RunningServer, run_server
from server_helpers import MESSAGES, assert_anthropic_error, assert_openai_error, wait_idle

MAX_BYTES = 4096
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def limited() -> Iterator[RunningServer]:
    args = ("--max-request-bytes", str(MAX_BYTES), "--max-queued-requests", str(MAX_QUEUED))
    with run_server(FAKE, args) as server:
        yield server


@pytest.fixture
def http(limited: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited.base_url, timeout=30.0) as client:
        yield client


def _big_chat(size: int) -> dict:
    return {"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 2}


def test_a_body_over_the_limit_is_413_in_each_protocol(http: httpx.Client):
    assert http.post("/v1/chat/completions", json=_big_chat(100)).status_code == 200
    error = assert_openai_error(http.post("/v1/chat/completions", json=_big_chat(MAX_BYTES)), 413, "body")
    assert str(MAX_BYTES) in error["message"] and "--max-request-bytes" in error["message"]
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x" * MAX_BYTES}), 413)
    assert_openai_error(http.post("/tokenize", json={"prompt": "x" * MAX_BYTES}), 413)
    error = assert_anthropic_error(http.post("/v1/messages", json=_big_chat(MAX_BYTES)), 413)
    assert error["type"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_413(http: httpx.Client):
    """No Content-Length to trust: the server counts while it reads."""
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 100 + 1):
            yield b"x" * 100
        yield b'", "max_tokens": 2}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413)


def test_past_max_queued_requests_new_requests_get_503_with_retry_after(http: httpx.Client):
    wait_idle(http)
    started = [threading.Event() for _ in range(MAX_QUEUED)]
    long = {"messages": MESSAGES, "max_tokens": 400, "stream": True}

    def stream(i: int) -> None:
        with http.stream("POST", "/v1/chat/completions", json={**long, "request_id": f"busy-{i}"}) as response:
            for _ in response.iter_lines():
                started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(MAX_QUEUED)]
    for thread in threads:
        thread.start()
    assert all(event.wait(10) for event in started)
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        response = http.post(path, json=body)
        assert_openai_error(response, 503)
        assert int(response.headers["Retry-After"]) >= 1
    response = http.post("/v1/messages", json={"messages": MESSAGES, "max_tokens": 2})
    assert assert_anthropic_error(response, 503)["type"] == "overloaded_error" and "Retry-After" in response.headers
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200  # not a generation request
    assert http.post("/abort", json={"all": True}).json() == {"aborted": MAX_QUEUED}
    for thread in threads:
        thread.join(10)
    wait_idle(http)
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


def test_a_prompt_list_longer_than_the_limit_is_a_400_not_a_503(http: httpx.Client):
    """It can never be admitted: a 503 "retry in 1 s" had clients (the openai client retries 503s) retry in vain."""
    wait_idle(http)
    body = {"prompt": ["a"] * (MAX_QUEUED + 1), "max_tokens": 2}
    assert "--max-queued-requests" in assert_openai_error(http.post("/v1/completions", json=body), 400,
                                                          "prompt")["message"]
    assert http.post("/v1/completions", json={**body, "prompt": ["a"] * MAX_QUEUED}).status_code == 200


def test_defaults_are_documented_in_help():
    from core.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    defaults = {a.dest: a.default for a in serve._actions}
    assert defaults["max_request_bytes"] == 8 * 1024 * 1024
    assert defaults["max_queued_requests"] == 1024


def test_a_client_that_leaves_while_its_body_is_sent_is_no_server_error(limited: RunningServer,
                                                                         http: httpx.Client):
    """Half a body, then the socket closes: starlette's ClientDisconnect while the body is read is the
    client's doing, answered quietly (no traceback in the log), and the next request is served."""
    import socket
    import time
    from urllib.parse import urlsplit

    address = urlsplit(limited.base_url)
    for _ in range(3):
        with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half")
            time.sleep(0.2)  # the route is reading the body when the client goes
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    time.sleep(0.3)
    assert "Traceback" not in limited.log()
