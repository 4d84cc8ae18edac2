"""`core bench offline`: the same datasets run in-process through `core.pipeline`, no HTTP in between.

Every request is submitted at once (the engine's continuous batching decides what runs together), and
each request's stream is timed like the serving benchmark's: TTFT at its first token, ITL between its
outputs, token counts from the engine. torch and the engine are imported only when this runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.bench import spec_decode
from core.bench.datasets import BenchRequest
from core.bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics, gaps_between
from core.bench.progress import make_progress


@dataclass
class _Timing:
    """One request's stream, folded output by output."""

    start: float
    times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finished_at: float | None = None

    def feed(self, output: Any, now: float) -> bool:
        """Take one RequestOutput; True when it is the request's last."""
        self.prompt_tokens = output.prompt_tokens
        self.output_tokens = max(self.output_tokens, output.completion_tokens)
        if output.token_ids:
            self.times.append(now)
        if output.finished:
            self.finished_at = now
        return output.finished

    def result(self) -> RequestResult:
        if not self.times or self.finished_at is None:
            return RequestResult(False, error="the request ended without any token")
        itl = gaps_between(self.times)
        return RequestResult(True, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
                             ttft=self.times[0] - self.start, latency=self.finished_at - self.start, itl=itl)


def generation_configs(requests: Sequence[BenchRequest], ignore_eos: bool) -> list[Any]:
    """One greedy GenerationConfig per request, with its output length."""
    from core.config import GenerationConfig

    return [GenerationConfig(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=ignore_eos)
            for r in requests]


def run_offline(pipe: Any, requests: Sequence[BenchRequest], *, ignore_eos: bool = True,
                progress: bool = True) -> BenchmarkMetrics:
    """Submit every request to `pipe` (a core Pipeline) at once and measure the streams."""
    if not requests:
        raise ValueError("no requests to run (num_prompts must be at least 1)")
    inputs = [list(r.messages) if r.is_chat else r.prompt for r in requests]
    configs = generation_configs(requests, ignore_eos)
    bar = make_progress(len(requests), "requests", progress)
    before = spec_decode.from_stats(pipe.engine.stats())
    start = time.perf_counter()
    timings = [_Timing(start) for _ in requests]
    try:
        for index, output in pipe.stream_infer(inputs, configs):
            if timings[index].feed(output, time.perf_counter()):
                bar.update(1)
    finally:
        bar.close()
    duration = time.perf_counter() - start
    metrics = compute_metrics([t.result() for t in timings], duration)
    counts = spec_decode.difference(before, spec_decode.from_stats(pipe.engine.stats()))
    return dataclasses.replace(metrics, spec_decode=counts.record()) if counts is not None else metrics


def warm_up(pipe: Any, request: BenchRequest) -> None:
    """One short untimed request, so one-time costs (first allocations, lazy imports) stay out of the run."""
    short = BenchRequest(prompt=request.prompt, messages=request.messages, output_len=min(4, request.output_len))
    run_offline(pipe, [short], progress=False)
