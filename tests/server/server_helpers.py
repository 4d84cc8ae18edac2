"""Small helpers shared by the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from core.testing.parse import parse_metrics

MESSAGES = [{"role": "user", "content": "Say something."}]


def metrics(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    return parse_metrics(response.text)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs and no KV block is used (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        sample = metrics(http)
        if sample["core:num_requests_running"] == 0 and sample["core:kv_cache_used_blocks"] == 0:
            return sample
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not become idle: {sample}")
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in error["message"]
    return error


def assert_anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def wait_counter(http: httpx.Client, before: dict[str, float], key: str, delta: float,
                 timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until `key` moved by `delta` since `before` (bounded); the last sample.

    A request is counted when its handler finishes, which can be just after the engine went idle.
    """
    deadline = time.monotonic() + timeout
    sample = metrics(http)
    while sample.get(key, 0) - before.get(key, 0) < delta and time.monotonic() < deadline:
        time.sleep(0.05)
        sample = metrics(http)
    assert sample.get(key, 0) - before.get(key, 0) == delta, (key, before.get(key), sample.get(key))
    return sample


def abort_while_running(http: httpx.Client, send: Callable[[], Any], request_id: str, running: int) -> Any:
    """`send()` on a thread; once `running` requests run (bounded wait), `/abort` by `request_id`, which must
    abort that many; `send`'s result once it returns."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(send()))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while metrics(http)["core:num_requests_running"] < running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert http.post("/abort", json={"request_id": request_id}).json() == {"aborted": running}
    finally:
        thread.join(30)
    [result] = answer
    return result
