"""`core bench serve`: drive a running OpenAI-compatible server and measure it, like vLLM's `bench serve`.

Requests arrive on a seeded Poisson schedule (or all at once with an infinite rate); at most
`max_concurrency` are in flight (the rest wait their turn, as in vLLM). One untimed request first checks
that the server answers, so a wrong URL or model fails at once with the server's own message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from core.bench import spec_decode
from core.bench.arrivals import arrival_gaps
from core.bench.client import StreamingClient
from core.bench.datasets import BenchRequest
from core.bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics
from core.bench.progress import make_progress


@dataclass(frozen=True)
class LoadOptions:
    """How the load is offered: arrival rate (requests/s, inf = all at once), concurrency cap, seed."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive or inf, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")


async def run_load(client: StreamingClient, requests: Sequence[BenchRequest],
                   options: LoadOptions) -> BenchmarkMetrics:
    """Send every request on the arrival schedule and return the run's metrics."""
    if not requests:
        raise ValueError("no requests to send (num_prompts must be at least 1)")
    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    progress = make_progress(len(requests), "requests", options.progress)

    async def one(request: BenchRequest) -> RequestResult:
        async with limit or contextlib.nullcontext():
            result = await client.send(request)
        progress.update(1)
        return result

    gaps = arrival_gaps(len(requests), options.request_rate, burstiness=options.burstiness, seed=options.seed)
    start = time.perf_counter()
    tasks = []
    try:
        for request, gap in zip(requests, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(request)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        progress.close()
    return compute_metrics(results, time.perf_counter() - start)


async def check_server(client: StreamingClient, request: BenchRequest) -> None:
    """One short untimed request; raises ConnectionError with the server's answer if it fails."""
    probe = BenchRequest(prompt=request.prompt, messages=request.messages, output_len=min(request.output_len, 4))
    result = await client.send(probe)
    if not result.success:
        raise ConnectionError(f"the test request failed: {result.error}")


async def benchmark_server(base_url: str, model: str, requests: Sequence[BenchRequest], options: LoadOptions, *,
                           api_key: str | None = None, ignore_eos: bool = True, check: bool = True,
                           extra_body: Mapping[str, Any] | None = None) -> BenchmarkMetrics:
    """Open a client, check the server once, then run the load."""
    async with StreamingClient(base_url, model, api_key=api_key, ignore_eos=ignore_eos,
                               extra_body=extra_body) as client:
        if check:
            await check_server(client, requests[0])
        before = await spec_decode.scrape(base_url, api_key)
        metrics = await run_load(client, requests, options)
    counts = spec_decode.difference(before, await spec_decode.scrape(base_url, api_key))
    return dataclasses.replace(metrics, spec_decode=counts.record()) if counts is not None else metrics


def result_record(metrics: BenchmarkMetrics, **settings: Any) -> dict[str, Any]:
    """What `--json` prints: the settings of the run, then its metrics."""
    clean = {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in settings.items()}
    return finite({"settings": clean, **asdict(metrics)})


def finite(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
