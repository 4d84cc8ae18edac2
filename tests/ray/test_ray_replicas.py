"""Two engine replicas of a tiny Llama on a local Ray cluster, behind one Ray Serve endpoint.

Through the official openai client over a socket: 20 requests (half streamed) succeed and both replicas
serve some; the Anthropic route and /health answer through the same endpoint; a replica killed mid-load
fails at most the requests it held (an error, never a hang), the others succeed, and Ray replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the Ray tests need ray[serve]: nox -s ray")
import httpx  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from core.config import EngineConfig  # noqa: E402
from core.ray import REPLICA_HEADER, engine_app  # noqa: E402

APP = "core-test"
REPLICAS = 2
REQUESTS = 20
CONCURRENCY = 4
MAX_TOKENS = 200  # about half a second a request: the load outlasts the kill
PROBE_TOKENS = 900  # the stream whose replica is killed: seconds long
MODEL = "tiny"
TIMEOUT_S = 60.0  # one request; a hang would show as openai.APITimeoutError
RESTART_TIMEOUT_S = 120.0
MESSAGES = [{"role": "user", "content": "Say something."}]


@dataclass
class Outcome:
    """One request through the endpoint: the replica that answered and the text, or the error."""

    replica: str | None = None
    text: str = ""
    error: Exception | None = None


@pytest.fixture(scope="module")
def endpoint(ray_cluster: Any, tiny_llama: Path, replica_actor_options: dict,
             free_port: Callable[[], int]) -> Iterator[str]:
    """http://127.0.0.1:PORT serving 2 replicas of the tiny Llama (half a CPU and one thread each)."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = EngineConfig(model=str(tiny_llama), backend="pytorch", kv_cache_memory_gib=0.02, max_num_seqs=8,
                          served_model_name=MODEL)
    app = engine_app(config, replicas=REPLICAS, ray_actor_options=replica_actor_options)
    serve.run(app, name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
        serve_until_both_replicas_answer(client)  # the proxy learns of each replica a moment after it runs
    yield url
    serve.delete(APP)


@pytest.fixture
def client(endpoint: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def ask(client: openai.OpenAI, stream: bool) -> Outcome:
    """One chat completion (streamed or not); an error is returned, not raised."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    try:
        return (ask_streamed if stream else ask_whole)(client, body)
    except openai.APIError as exc:
        return Outcome(error=exc)


def ask_whole(client: openai.OpenAI, body: dict) -> Outcome:
    raw = client.chat.completions.with_raw_response.create(**body)
    return Outcome(replica=raw.headers.get(REPLICA_HEADER), text=raw.parse().choices[0].message.content or "")


def ask_streamed(client: openai.OpenAI, body: dict) -> Outcome:
    with client.chat.completions.with_streaming_response.create(**body, stream=True) as response:
        chunks = list(response.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert any(c.choices and c.choices[0].finish_reason for c in chunks), "the stream ended without a finish"
        return Outcome(replica=response.headers.get(REPLICA_HEADER), text=text)


def run_load(client: openai.OpenAI, count: int, during: Callable[[list[Future]], None] | None = None) -> list[Outcome]:
    """`count` requests, CONCURRENCY at a time, every other one streamed; `during(futures)` runs meanwhile."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(ask, client, i % 2 == 1) for i in range(count)]
        if during is not None:
            during(futures)
        return [f.result(timeout=TIMEOUT_S * count) for f in futures]


def test_requests_spread_over_both_replicas(client: openai.OpenAI) -> None:
    outcomes = run_load(client, REQUESTS)
    assert [o.error for o in outcomes if o.error] == []
    assert all(o.text for o in outcomes)
    assert len({o.replica for o in outcomes}) == REPLICAS, [o.replica for o in outcomes]


def test_anthropic_route_and_health(endpoint: str) -> None:
    with httpx.Client(base_url=endpoint, timeout=TIMEOUT_S) as http:
        assert http.get("/health").json() == {"status": "ok"}
        body = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES, "stream": True}
        with http.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200 and response.headers[REPLICA_HEADER]
            events = [line for line in response.iter_lines() if line.startswith("event:")]
        assert events[0] == "event: message_start" and events[-1] == "event: message_stop"


def replica_actor(replica_id: str) -> Any:
    """The Ray actor of the replica whose id a response named."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].endswith(f"#{replica_id}"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["Engine"]
    return status.replica_states.get("RUNNING", 0)


def stream_then_kill_its_replica(client: openai.OpenAI) -> tuple[str, Exception | None]:
    """A long stream: once it has started, its replica is killed; its id and how the stream ended."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": PROBE_TOKENS, "stream": True}
    with client.chat.completions.with_streaming_response.create(**body) as response:
        victim = response.headers[REPLICA_HEADER]
        chunks = iter(response.parse())
        try:
            next(chunks)
            ray.kill(replica_actor(victim), no_restart=True)
            for _ in chunks:
                pass
        except (openai.APIError, httpx.HTTPError) as exc:
            return victim, exc
    return victim, None


def test_killed_replica_fails_only_its_requests_and_is_replaced(client: openai.OpenAI) -> None:
    probe: list[tuple[str, Exception | None]] = []

    def kill_mid_load(futures: list[Future]) -> None:
        while sum(f.done() for f in futures) < CONCURRENCY // 2:  # the load is under way
            time.sleep(0.02)
        probe.append(stream_then_kill_its_replica(client))

    started = time.monotonic()
    outcomes = run_load(client, REQUESTS, during=kill_mid_load)
    victim, probe_error = probe[0]
    assert probe_error is not None, "a stream whose replica was killed ended as if complete"
    assert not isinstance(probe_error, (openai.APITimeoutError, httpx.TimeoutException)), "the stream hung"
    failures = [o.error for o in outcomes if o.error]
    assert len(failures) <= CONCURRENCY, failures  # at most what the killed replica held
    assert not [f for f in failures if isinstance(f, openai.APITimeoutError)], f"a request hung: {failures}"
    assert time.monotonic() - started < TIMEOUT_S
    served_after = serve_until_both_replicas_answer(client)
    assert victim not in served_after and len(served_after) == REPLICAS


def serve_until_both_replicas_answer(client: openai.OpenAI) -> set[str]:
    """Loads of CONCURRENCY requests, every one a success, until two replicas answered (the proxy learns
    of a replica a moment after Ray reports it running); the replicas that answered the last load."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        outcomes = run_load(client, CONCURRENCY) if running_replicas() == REPLICAS else []
        assert [o.error for o in outcomes if o.error] == []
        served = {o.replica for o in outcomes if o.replica}
        if len(served) == REPLICAS:
            return served
        assert time.monotonic() < deadline, "Ray did not replace the killed replica"
        time.sleep(0.5)
