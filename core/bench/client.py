"""An asynchronous streaming OpenAI client that times every chunk (TTFT, ITL, end-to-end latency).

It speaks plain HTTP (httpx) to `/v1/completions` or `/v1/chat/completions` of any OpenAI-compatible
server, asks for `stream_options.include_usage` and takes the token counts from the server's `usage`
(no local tokenizer). A server that sends no usage is measured anyway: its non-empty chunks are counted
and the result says so (`usage_reported=False`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import httpx

from core.bench.datasets import BenchRequest
from core.bench.metrics import RequestResult, gaps_between


class StreamingClient:
    """Sends BenchRequests to one server and model; use as an async context manager."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, ignore_eos: bool = True,
                 temperature: float = 0.0, timeout_s: float = 600.0, max_connections: int = 1024,
                 transport: httpx.AsyncBaseTransport | None = None, extra_body: Mapping[str, Any] | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.ignore_eos, self.temperature = model, ignore_eos, temperature
        self.extra_body = dict(extra_body or {})  # server-specific fields, e.g. llama-cpp-python's min_tokens
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                                       timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport)

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    def body(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body of a streamed request with a fixed output length."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        if request.is_chat:
            body["messages"] = [dict(m) for m in request.messages or ()]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        """Send one request and time its stream; failures become a result with `success=False`."""
        path = "/v1/chat/completions" if request.is_chat else "/v1/completions"
        timer = _StreamTimer(time.perf_counter())
        try:
            async with self._http.stream("POST", path, json=self.body(request)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    return RequestResult(False, error=f"HTTP {response.status_code}: {text[:200]}")
                async for line in response.aiter_lines():
                    if timer.feed(line):
                        break
        except (httpx.HTTPError, ValueError) as exc:
            return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:300])
        return timer.result(time.perf_counter())


class _StreamTimer:
    """Folds the server-sent events of one response into timings and token counts."""

    def __init__(self, start: float):
        self.start = start
        self.chunk_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error = ""

    def feed(self, line: str) -> bool:
        """Take one SSE line; True at `[DONE]`."""
        if not line.startswith("data:"):
            return False
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk and not chunk.get("choices"):
            self.error = str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict)
                             else chunk["error"])[:200]
            return True
        if _has_text(chunk):
            self.chunk_times.append(time.perf_counter())
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return False

    def result(self, end: float) -> RequestResult:
        if self.error:
            return RequestResult(False, error=f"stream error: {self.error}")
        if not self.chunk_times:
            return RequestResult(False, error="the stream ended without any token")
        times = self.chunk_times
        itl = gaps_between(times)
        if self.usage is not None:
            return RequestResult(True, prompt_tokens=int(self.usage.get("prompt_tokens") or 0),
                                 output_tokens=int(self.usage.get("completion_tokens") or 0),
                                 ttft=times[0] - self.start, latency=end - self.start, itl=itl)
        return RequestResult(True, output_tokens=len(times), ttft=times[0] - self.start,
                             latency=end - self.start, itl=itl, usage_reported=False)


def _has_text(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text (completion `text` or chat `delta` content/reasoning)."""
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
    return False


async def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists at /v1/models (when --model is not given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
