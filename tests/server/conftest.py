"""A real `core serve` subprocess per test module, driven over HTTP.

`SERVER_SPECS` lists the servers every server test module runs against. The fake backend (from
fake_backend_plugin.py) is always there; to add a tiny real model, append e.g.
`ServerSpec("tiny-llama", backend="pytorch", model="/path/to/checkpoint")` — tests that depend on the
fake backend's exact behaviour check `server.spec.is_fake`. A module can add command-line flags with a
module-level `SERVER_ARGS` tuple and environment variables with `SERVER_ENV`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent
# pytest runs with --import-mode=importlib, which leaves sys.path alone: make server_helpers importable.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSpec:
    """Which backend and model a test server runs."""

    name: str
    backend: str
    model: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_fake(self) -> bool:
        return self.backend == "fake"


# CORE_PLUGINS="" loads no installed plugin: the fake server depends on nothing but the core.
FAKE = ServerSpec("fake", backend="fake", args=("--chat-template", "tiny-chatml"), env={"CORE_PLUGINS": ""})
SERVER_SPECS = [FAKE]


@dataclass
class RunningServer:
    """A started `core serve` process."""

    spec: ServerSpec
    base_url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(spec: ServerSpec, port: int, extra_args: tuple[str, ...]) -> list[str]:
    model = [spec.model] if spec.model else []
    return [sys.executable, "-m", "core.cli", "serve", *model, "--backend", spec.backend, "--host", "127.0.0.1",
            "--port", str(port), *spec.args, *extra_args]


def _wait_healthy(server: RunningServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"core serve exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url("/health"), timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"core serve did not become healthy in {START_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: RunningServer, timeout: float = 15.0) -> int:
    """Ctrl-C the server and wait for it; kill it if it hangs. Returns its exit status."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=5)
    return server.process.returncode


@contextmanager
def run_server(spec: ServerSpec, extra_args: tuple[str, ...] = (), env: Mapping[str, str] | None = None,
               api_key: str | None = None) -> Iterator[RunningServer]:
    """Start `core serve` on a free port, wait for /health, and stop it afterwards."""
    port = free_port()
    environment = {**os.environ, "CORE_EXTRA_PLUGINS": "fake_backend_plugin",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
                   **spec.env, **(env or {})}
    with tempfile.NamedTemporaryFile("w+b", prefix="core-serve-", suffix=".log", delete=False) as log_file:
        process = subprocess.Popen(_command(spec, port, extra_args), env=environment, stdout=log_file,
                                   stderr=subprocess.STDOUT)
    server = RunningServer(spec, f"http://127.0.0.1:{port}", process, Path(log_file.name), api_key)
    try:
        _wait_healthy(server)
        yield server
    finally:
        stop_server(server)
        server.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module", params=SERVER_SPECS, ids=lambda spec: spec.name)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """One server per test module (and per spec in SERVER_SPECS)."""
    args = tuple(getattr(request.module, "SERVER_ARGS", ()))
    env = dict(getattr(request.module, "SERVER_ENV", {}))
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    with run_server(request.param, args, env, api_key) as running:
        yield running


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    """An httpx client bound to the server (with its API key, if any)."""
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30.0) as client:
        yield client


@pytest.fixture
def client(server: RunningServer):
    """The official OpenAI client pointed at the server."""
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key or "unused", max_retries=0,
                       timeout=30.0) as c:
        yield c


@pytest.fixture
def model(server: RunningServer, http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]
