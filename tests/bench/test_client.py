"""The streaming client against scripted SSE responses: timing, usage, fallbacks and errors."""

from __future__ import annotations

import asyncio
import json

import httpx

from core.bench.client import StreamingClient
from core.bench.datasets import BenchRequest
from core.bench.serve import LoadOptions, run_load


def sse(*chunks: object) -> bytes:
    lines = [f"data: {json.dumps(c) if not isinstance(c, str) else c}\n\n" for c in chunks]
    return "".join(lines).encode()


def completion_stream(texts: list[str], usage: dict | None) -> bytes:
    chunks: list[object] = [{"choices": [{"index": 0, "text": t}]} for t in texts]
    if usage is not None:
        chunks.append({"choices": [], "usage": usage})
    return sse(*chunks, "[DONE]")


def client_for(handler) -> StreamingClient:
    return StreamingClient("http://test", "m", transport=httpx.MockTransport(handler))


async def test_completion_timings_and_usage_and_request_body():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=completion_stream(["a", "", "b", "c"], {"prompt_tokens": 9,
                                                                                   "completion_tokens": 3}))

    async with client_for(handler) as client:
        result = await client.send(BenchRequest(prompt="hi there", output_len=3))
    assert seen["path"] == "/v1/completions"
    assert seen["body"]["max_tokens"] == 3 and seen["body"]["ignore_eos"] is True
    assert seen["body"]["stream_options"] == {"include_usage": True} and seen["body"]["prompt"] == "hi there"
    assert result.success and (result.prompt_tokens, result.output_tokens) == (9, 3)
    assert len(result.itl) == 2  # three chunks with text, the empty one does not count
    assert 0 <= result.ttft <= result.latency


async def test_chat_requests_go_to_chat_completions_and_read_deltas():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"][-1] == {"role": "user", "content": "q"}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "x"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "y"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}, "[DONE]"]
        return httpx.Response(200, content=sse(*chunks))

    async with client_for(handler) as client:
        result = await client.send(BenchRequest(messages=({"role": "user", "content": "q"},), output_len=2))
    assert result.success and result.output_tokens == 2 and len(result.itl) == 1


async def test_without_usage_chunks_are_counted_and_flagged():
    async with client_for(lambda r: httpx.Response(200, content=completion_stream(["a", "b"], None))) as client:
        result = await client.send(BenchRequest(prompt="p", output_len=2))
    assert result.success and result.output_tokens == 2 and result.usage_reported is False


async def test_http_errors_and_empty_streams_fail_with_a_reason():
    async with client_for(lambda r: httpx.Response(400, json={"error": {"message": "bad max_tokens"}})) as client:
        result = await client.send(BenchRequest(prompt="p", output_len=2))
    assert not result.success and "HTTP 400" in result.error and "bad max_tokens" in result.error
    async with client_for(lambda r: httpx.Response(200, content=sse("[DONE]"))) as client:
        result = await client.send(BenchRequest(prompt="p", output_len=2))
    assert not result.success and "without any token" in result.error


class CountingClient(StreamingClient):
    """Records how many sends are in flight at once."""

    def __init__(self) -> None:
        body = completion_stream(["a"], {"prompt_tokens": 1, "completion_tokens": 1})
        super().__init__("http://test", "m", transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body)))
        self.now = self.peak = 0

    async def send(self, request: BenchRequest):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.01)
            return await super().send(request)
        finally:
            self.now -= 1


async def test_run_load_respects_max_concurrency():
    async with CountingClient() as client:
        metrics = await run_load(client, [BenchRequest(prompt="p", output_len=1)] * 12,
                                 LoadOptions(max_concurrency=3, progress=False))
    assert metrics.completed == 12 and metrics.total_output_tokens == 12
    assert client.peak == 3


async def test_run_load_follows_the_arrival_rate():
    async with CountingClient() as client:
        metrics = await run_load(client, [BenchRequest(prompt="p", output_len=1)] * 20,
                                 LoadOptions(request_rate=200.0, seed=1, progress=False))
    # 19 gaps of mean 5 ms: the run cannot be faster than the arrivals allow
    assert metrics.completed == 20 and metrics.duration_s > 0.03
    assert client.peak < 20


def test_extra_body_fields_are_sent_and_ignore_eos_can_be_off():
    client = StreamingClient("http://test", "m", ignore_eos=False, extra_body={"min_tokens": 7, "top_k": 1})
    body = client.body(BenchRequest(prompt="p", output_len=7))
    assert body["min_tokens"] == 7 and body["top_k"] == 1 and "ignore_eos" not in body
