"""Process lifecycle of `core serve`: SIGTERM drains (in-flight requests finish, up to --shutdown-timeout,
then the rest are aborted) and exits 0; a dead engine thread stops the process with a non-zero status."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import threading

import httpx
import pytest
from conftest import FAKE, TINY_LLAMA, resolve_spec, run_server

EXIT_TIMEOUT_S = 60


def _stream_completion(server, body: dict, started: threading.Event, result: dict) -> None:
    """POST a streamed completion; record the finish reasons and whether [DONE] came."""
    finishes, done = [], False
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http, \
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            if line == "data: [DONE]":
                done = True
                continue
            finishes += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    result.update(finishes=finishes, done=done)


def _sigterm_mid_stream(server, body: dict) -> tuple[dict, int]:
    started, result = threading.Event(), {}
    worker = threading.Thread(target=_stream_completion, args=(server, body, started, result))
    worker.start()
    assert started.wait(30), "the stream never started"
    server.process.send_signal(signal.SIGTERM)
    worker.join(EXIT_TIMEOUT_S)
    try:
        status = server.process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"core serve did not exit after SIGTERM:\n{server.log()[-3000:]}")
    return result, status


def test_sigterm_lets_requests_in_flight_finish_then_exits_0(request):
    spec = resolve_spec(TINY_LLAMA, request)
    with run_server(spec, ("--shutdown-timeout", "60")) as server:
        body = {"prompt": "Once", "max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
        result, status = _sigterm_mid_stream(server, body)
        log = server.log()
    assert result == {"finishes": ["length"], "done": True}, log[-3000:]
    assert status == 0, log[-3000:]
    assert "draining" in log and "engine closed" in log and "Traceback" not in log


def test_sigterm_past_the_shutdown_timeout_aborts_the_rest_and_exits_0(request):
    slow = dataclasses.replace(FAKE, env={**FAKE.env, "CORE_FAKE_STEP_DELAY": "0.02"})
    with run_server(slow, ("--shutdown-timeout", "0.3")) as server:
        result, status = _sigterm_mid_stream(server, {"prompt": "Once", "max_tokens": 400})
        log = server.log()
    assert result == {"finishes": ["abort"], "done": True}, log[-3000:]
    assert status == 0 and "aborted 1 request(s)" in log, log[-3000:]


def test_a_dead_engine_thread_stops_the_process_with_a_non_zero_status(request):
    from dying_backend_plugin import DIE_PROMPT

    spec = dataclasses.replace(resolve_spec(TINY_LLAMA, request), backend="dying")
    env = {"CORE_EXTRA_PLUGINS": "fake_backend_plugin,dying_backend_plugin"}
    with run_server(spec, env=env) as server:
        with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
            response = http.post("/v1/completions", json={"prompt": DIE_PROMPT, "max_tokens": 5})
        assert response.status_code == 500  # the request in flight is failed, not left hanging
        try:
            status = server.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"core serve kept running with a dead engine:\n{server.log()[-3000:]}")
        log = server.log()
    assert status == 1, log[-3000:]
    assert "the engine has died" in log and "engine closed" in log
