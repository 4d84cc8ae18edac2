"""Metrics move exactly; clients that leave free their KV blocks; errors mid-stream end cleanly."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
from server_helpers import MESSAGES, metrics, wait_counter, wait_idle

from core.testing.parse import parse_sse


def test_metrics_counters_move_by_exactly_one_request(http: httpx.Client, client: openai.OpenAI, model: str):
    before = wait_idle(http)
    response = client.completions.create(model=model, prompt="count me", max_tokens=5)
    after = metrics(http)
    assert after["core:prompt_tokens_total"] - before["core:prompt_tokens_total"] == response.usage.prompt_tokens
    assert after["core:generation_tokens_total"] - before["core:generation_tokens_total"] == 5
    key = 'core:requests_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    assert after["core:e2e_request_latency_seconds_count"] - before["core:e2e_request_latency_seconds_count"] == 1
    assert after["core:time_to_first_token_seconds_count"] - before["core:time_to_first_token_seconds_count"] == 1
    assert after["core:inter_token_latency_seconds_count"] - before["core:inter_token_latency_seconds_count"] == 4
    assert after["core:kv_cache_total_blocks"] > 0


def test_prefix_cache_counters_move_with_the_cached_tokens_of_usage(server, http: httpx.Client):
    if server.spec.is_fake:
        pytest.skip("the fake backend has no prefix cache")
    prompt = f"{uuid.uuid4().hex} " * 3  # a prefix no earlier request sent
    samples, usages = [wait_idle(http)], []
    for _ in range(2):
        usages.append(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"])
        samples.append(metrics(http))
    for usage, before, after in zip(usages, samples[:-1], samples[1:], strict=True):
        moved = {k: after[k] - before[k] for k in ("core:prefix_cache_queries_total", "core:prefix_cache_hits_total")}
        assert moved == {"core:prefix_cache_queries_total": usage["prompt_tokens"],
                         "core:prefix_cache_hits_total": usage["prompt_tokens_details"]["cached_tokens"]}
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < usages[1]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens"]


def test_client_closing_mid_stream_frees_its_blocks(http: httpx.Client, long_tokens: int):
    before = wait_idle(http)
    body = {"messages": MESSAGES, "max_tokens": long_tokens, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metrics(http)["core:kv_cache_used_blocks"] > 0
    wait_idle(http)
    after = wait_counter(http, before, 'core:requests_total{finished_reason="abort"}', 1)
    assert after["core:generation_tokens_total"] - before["core:generation_tokens_total"] < long_tokens


def test_client_leaving_a_non_streamed_request_aborts_it(server, http: httpx.Client, long_tokens: int):
    before = wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json={"prompt": "slow", "max_tokens": long_tokens},
                   headers=server.headers, timeout=0.3)
    wait_idle(http, timeout=5)
    wait_counter(http, before, 'core:requests_total{finished_reason="abort"}', 1)


async def _one(client: openai.AsyncOpenAI, model: str, i: int, cancel: bool, long_tokens: int) -> str | None:
    stream = await client.completions.create(model=model, prompt=f"request {i}", max_tokens=long_tokens if cancel else 60,
                                             temperature=0.0, stream=True)
    text = []
    async for chunk in stream:
        text.append(chunk.choices[0].text)
        if cancel and len(text) == 3:
            await stream.close()
            return None
    return "".join(text)


async def test_fifty_concurrent_streams_with_twenty_cancelled(server, http: httpx.Client, model: str,
                                                              long_tokens: int):
    wait_idle(http)
    async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=30) as client:
        wholes = await asyncio.gather(*(client.completions.create(model=model, prompt=f"request {i}", max_tokens=60,
                                                                  temperature=0.0) for i in range(50) if i % 5 >= 2))
        expected = [w.choices[0].text for w in wholes]
        results = await asyncio.wait_for(
            asyncio.gather(*(_one(client, model, i, i % 5 < 2, long_tokens) for i in range(50))), timeout=60)
    assert sum(r is None for r in results) == 20
    assert [r for r in results if r is not None] == expected
    idle = wait_idle(http, timeout=10)
    assert idle["core:num_requests_running"] == 0 and idle["core:kv_cache_used_blocks"] == 0


def test_error_mid_stream_ends_with_an_error_event_then_done(server, http: httpx.Client):
    if not server.spec.is_fake:
        pytest.skip("needs the fake backend's injected failure (a real model has no input that fails midway)")
    body = {"prompt": "please BOOM", "max_tokens": 20, "stream": True}
    lines = [line for line in http.post("/v1/completions", json=body).text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "internal" and "secret" not in error["message"]
    assert sum(1 for line in lines if '"text"' in line) == 3  # three tokens made it out first
    whole = http.post("/v1/completions", json={**body, "stream": False})
    assert whole.status_code == 500 and "secret" not in whole.text and "Traceback" not in whole.text
    anthropic = http.post("/v1/messages", json={"max_tokens": 20, "stream": True,
                                                "messages": [{"role": "user", "content": "BOOM"}]})
    events = parse_sse(anthropic.text)
    assert [name for name, _ in events][:2] == ["message_start", "content_block_start"]
    assert events[-1][0] == "error" and json.loads(events[-1][1])["error"]["type"] == "api_error"
    assert http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3}).status_code == 200
    wait_idle(http)
