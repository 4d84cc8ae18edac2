"""Prometheus metrics: request latencies and token counters kept here, engine gauges read per scrape.

The text exposition format is small enough to write directly (no prometheus_client dependency). Names
follow vLLM's (`vllm:` becomes `core:`), so existing dashboards need only a prefix change.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.backend import BackendStats
from core.request import RequestOutput
from core.speculative import SpecDecodeStats
from core.stream import RequestStream

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0)
PREFIX = "core:"


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics)."""

    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i in range(bisect.bisect_left(self.buckets, value), len(self.buckets)):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


@dataclass
class Metrics:
    """Server-side counters; engine gauges come from BackendStats at scrape time."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def finish(self, reason: str, prompt_tokens: int, generation_tokens: int, started: float) -> None:
        """Count one finished request (any outcome: stop, length, abort, error)."""
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.e2e.observe(time.perf_counter() - started)

    def track(self, stream: RequestStream) -> TrackedStream:
        """The stream's outputs, timed; closing it (iterated or not) closes the stream and counts it."""
        return TrackedStream(self, stream)

    def render(self, stats: BackendStats, model_name: str) -> str:
        """The whole scrape in Prometheus text format."""
        lines: list[str] = []
        gauges = (
            ("num_requests_running", stats.running, "Requests in the running batch."),
            ("num_requests_waiting", stats.waiting, "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", stats.kv_cache_usage, "Fraction of KV-cache blocks in use (0-1)."),
            ("kv_cache_used_blocks", stats.kv_blocks_used, "KV-cache blocks in use."),
            ("kv_cache_total_blocks", stats.kv_blocks_total, "KV-cache blocks in total."),
            ("is_sleeping", int(stats.is_sleeping), "1 while the engine is asleep."),
        )
        for name, value, help_text in gauges:
            lines += _sample(PREFIX + name, "gauge", help_text, value)
        counters = (
            ("prefix_cache_queries_total", stats.prefix_cache_queries, "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits_total", stats.prefix_cache_hits, "Prompt tokens found in the prefix cache."),
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            ("generation_tokens_total", self.generation_tokens, "Generated tokens of finished requests."),
        )
        for name, value, help_text in counters:
            lines += _sample(PREFIX + name, "counter", help_text, value)
        if stats.spec_decode is not None:
            lines += _spec_decode_lines(stats.spec_decode)
        lines += [f"# HELP {PREFIX}requests_total Finished requests by finish reason.",
                  f"# TYPE {PREFIX}requests_total counter"]
        lines += [f'{PREFIX}requests_total{{finished_reason="{r}"}} {n}' for r, n in sorted(self.requests.items())]
        lines += self.ttft.render(PREFIX + "time_to_first_token_seconds", "Time to the first generated token.")
        lines += self.itl.render(PREFIX + "inter_token_latency_seconds", "Time between generated outputs.")
        lines += self.e2e.render(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.")
        lines += [f"# HELP {PREFIX}model_info The served model.", f"# TYPE {PREFIX}model_info gauge"]
        lines.append(f'{PREFIX}model_info{{model_name="{_escape(model_name)}"}} 1')
        return "\n".join(lines) + "\n"


def _spec_decode_lines(spec: SpecDecodeStats) -> list[str]:
    """Speculative decoding's counters, as vLLM names them, and the acceptance rate they give."""
    lines: list[str] = []
    counters = (
        ("spec_decode_num_drafts_total", spec.num_drafts, "Rows that verified proposed tokens."),
        ("spec_decode_num_draft_tokens_total", spec.num_draft_tokens, "Proposed tokens verified."),
        ("spec_decode_num_accepted_tokens_total", spec.num_accepted_tokens, "Proposed tokens accepted."),
    )
    for name, value, help_text in counters:
        lines += _sample(PREFIX + name, "counter", help_text, value)
    lines += _sample(PREFIX + "spec_decode_acceptance_rate", "gauge",
                     "Accepted over proposed tokens since start (0-1).", spec.acceptance_rate)
    name = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Accepted proposed tokens by their position in the proposal.",
              f"# TYPE {name} counter"]
    lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(spec.accepted_per_position)]
    return lines


class TrackedStream:
    """One request's outputs, timed into `Metrics` as they pass; finished, failed or closed early, the
    request is counted exactly once and its stream closed (freeing its blocks), even when it is closed
    before its first output (a client that left while it was being prepared)."""

    def __init__(self, metrics: Metrics, stream: RequestStream) -> None:
        self._metrics, self._stream = metrics, stream
        self._started = self._last = time.perf_counter()
        self._first = True
        self._counts: dict[int, int] = {}
        self._reasons: dict[int, str] = {}
        self._closed = False

    def __aiter__(self) -> TrackedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._stream.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise
        except Exception:
            self._reasons.setdefault(0, "error")
            await self.aclose()
            raise
        except BaseException:  # cancelled: counted as "abort"
            await self.aclose()
            raise
        self._observe(output)
        return output

    def _observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        if output.token_ids:
            metrics = self._metrics
            (metrics.ttft if self._first else metrics.itl).observe(now - (self._started if self._first else self._last))
            self._first, self._last = False, now
        self._counts[output.index] = output.completion_tokens
        if output.finish_reason:
            self._reasons[output.index] = output.finish_reason

    async def aclose(self) -> None:
        """Close the stream and count the request (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()
        finally:
            self._metrics.finish(self._reasons.get(0, "abort"), len(self._stream.prompt_token_ids),
                                 sum(self._counts.values()), self._started)


def _sample(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
