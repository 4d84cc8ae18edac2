"""`core serve MODEL --replicas 2`: a subprocess that starts its own local Ray instance, serves the tiny
Llama from two replicas on one port, and on SIGTERM exits 0 leaving none of its processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the Ray tests need ray[serve]: nox -s ray")
import httpx  # noqa: E402
import openai  # noqa: E402

from core.ray import REPLICA_HEADER  # noqa: E402

START_TIMEOUT_S = 240.0  # a Ray instance and two replicas on a loaded 2-core machine
STOP_TIMEOUT_S = 60.0
BOTH_SERVE_TIMEOUT_S = 60.0
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def replicas_server(tiny_llama: Path, free_port: Callable[[], int],
                    replica_env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """`core serve --replicas 2` on its own local Ray instance (the base URL); killed with its processes
    if the test leaves it running."""
    port = free_port()
    command = [sys.executable, "-m", "core.cli", "serve", str(tiny_llama), "--replicas", "2", "--ray-address", "local",
               "--replica-cpus", "0.5", "--host", "127.0.0.1", "--port", str(port), "--backend", "pytorch",
               "--kv-cache-memory", "0.02", "--served-model-name", MODEL]
    process = subprocess.Popen(command, env={**os.environ, **replica_env}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            for pid in descendants(process.pid):
                os.kill(pid, signal.SIGKILL)
            process.kill()
            process.wait()


def wait_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, f"core serve --replicas exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "core serve --replicas did not become healthy"
        time.sleep(1.0)


def replicas_answering(url: str) -> set[str]:
    """The replicas that answered loads of 4 concurrent streamed requests, until two did (for at most
    BOTH_SERVE_TIMEOUT_S: /health answers once one replica runs, and the proxy learns of the second later)."""
    served: set[str] = set()
    deadline = time.monotonic() + BOTH_SERVE_TIMEOUT_S
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        def ask(_: int) -> str:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "stream": True}
            with client.chat.completions.with_streaming_response.create(**body) as response:
                assert any(c.choices and c.choices[0].finish_reason for c in response.parse())
                return response.headers[REPLICA_HEADER]

        with ThreadPoolExecutor(4) as pool:
            while len(served) < 2 and time.monotonic() < deadline:
                served |= set(pool.map(ask, range(4)))
                time.sleep(0.2)
    return served


def test_serve_replicas_command_serves_from_both_and_stops_cleanly_on_sigterm(replicas_server) -> None:
    process, url = replicas_server
    wait_healthy(process, url)
    assert len(replicas_answering(url)) == 2
    started = descendants(process.pid)
    assert started, "the Ray instance's processes should run under the command"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=STOP_TIMEOUT_S) == 0
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while left := [pid for pid in started if alive(pid)]:
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.5)
