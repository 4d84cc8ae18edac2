"""A replica's app and health check (core.ray.replica) and its middlewares (core.ray.middleware), over the
fake backend: no Ray cluster, only ray importable (core.ray needs it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="core.ray needs ray[serve]: nox -s ray")
import httpx  # noqa: E402

from core.engine import AsyncEngine  # noqa: E402
from core.ray.middleware import REPLICA_HEADER, BodyDeadlineMiddleware, ReplicaHeaderMiddleware  # noqa: E402
from core.ray.replica import EngineDiedError, EngineReplica  # noqa: E402
from core.server.app import build_app  # noqa: E402
from core.testing.fake import FakeBackend  # noqa: E402

WAIT_S = 0.1


@pytest.fixture
async def app() -> AsyncIterator[Any]:
    """The server's app over a fake engine (5 ms a token), with both middlewares as a replica adds them."""
    engine = AsyncEngine(FakeBackend(step_delay=0.005))
    app = build_app(engine)
    app.add_middleware(BodyDeadlineMiddleware, wait_s=WAIT_S)
    app.add_middleware(ReplicaHeaderMiddleware, replica_id="r1")
    yield app
    await engine.close()


async def call_without_body(app: Any, path: str) -> tuple[int, dict]:
    """POST `path` whose body never arrives (as on a replica after Ray re-sent a request); status, JSON."""
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.Event().wait()  # never
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"20")],
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    await asyncio.wait_for(app(scope, receive, send), 10 * WAIT_S)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert (REPLICA_HEADER.lower().encode(), b"r1") in start["headers"]
    return start["status"], json.loads(body)


async def test_a_body_that_never_comes_is_a_503_in_the_routes_protocol(app: Any) -> None:
    status, body = await call_without_body(app, "/v1/chat/completions")
    assert status == 503 and "retry" in body["error"]["message"]
    status, body = await call_without_body(app, "/v1/messages")
    assert status == 503 and body["type"] == "error" and body["error"]["type"]


async def test_a_stream_outlasting_the_deadline_is_untouched(app: Any) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        body = {"prompt": "hello", "max_tokens": 60, "stream": True}  # 60 tokens at 5 ms: over WAIT_S
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] == "r1"
            lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2


class GarbageSafeReplica(EngineReplica):
    """Python's garbage collector calls `__del__` too, where Ray's wrapper class awaits it: not here."""

    def __del__(self) -> None:
        pass


async def test_the_replica_serves_the_server_app_and_fails_its_health_check_once_its_engine_died(monkeypatch):
    monkeypatch.setattr("core.ray.replica.current_replica_id", lambda: "r7")
    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, config: cls(FakeBackend())))
    replica = GarbageSafeReplica(config=None, app_options={"web_ui": False})  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=replica.__serve_build_asgi_app__())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get("/health")
        assert response.json() == {"status": "ok"} and response.headers[REPLICA_HEADER] == "r7"
        assert (await http.get("/")).status_code == 404  # app_options reached build_app
        replica.check_health()
        await EngineReplica.__del__(replica)  # Ray's graceful shutdown closes the engine
        assert (await http.get("/health")).status_code == 503
    with pytest.raises(EngineDiedError, match="r7"):
        replica.check_health()
