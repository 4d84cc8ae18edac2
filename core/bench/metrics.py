"""Benchmark metrics: per-request measurements in, throughput and latency statistics out.

Definitions follow vLLM's `bench serve`:
- TTFT: time from sending a request to its first streamed token;
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1), for requests with 2+ tokens;
- ITL: every gap between two consecutive streamed chunks, over all requests;
- E2EL: time from sending a request to its last byte;
- throughputs divide by the wall time of the whole run (first send to last completion).
Latencies are reported in milliseconds as mean, median and p99 (and the standard deviation).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; token counts come from the server."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    usage_reported: bool = True

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Stat:
    """Summary of one latency, in milliseconds."""

    mean: float
    median: float
    p99: float
    std: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Stat:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = [v * 1000.0 for v in values]
        return cls(statistics.fmean(ms), statistics.median(ms), percentile(ms, 99.0),
                   statistics.pstdev(ms) if len(ms) > 1 else 0.0)


def gaps_between(times: Sequence[float]) -> list[float]:
    """The inter-token latencies of one stream: differences between consecutive chunk times."""
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The whole run's numbers (what `--json` prints)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    usage_missing: int = 0
    errors: tuple[str, ...] = ()
    # speculative decoding during the run (core.bench.spec_decode): drafts, draft and accepted tokens, rate
    spec_decode: Mapping[str, Any] | None = None


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchmarkMetrics:
    """Aggregate per-request results over a run that took `duration_s` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    return BenchmarkMetrics(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(done) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Stat.of_seconds([r.ttft for r in done]),
        tpot_ms=Stat.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl_ms=Stat.of_seconds([gap for r in done for gap in r.itl]),
        e2el_ms=Stat.of_seconds([r.latency for r in done]),
        usage_missing=sum(1 for r in done if not r.usage_reported),
        errors=tuple(sorted({r.error for r in results if not r.success}))[:5],
    )


def format_report(metrics: BenchmarkMetrics, title: str = "Serving benchmark result") -> str:
    """A fixed-width text report like vLLM's."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{metrics.completed}"),
        ("Failed requests", f"{metrics.failed}"),
        ("Benchmark duration (s)", f"{metrics.duration_s:.2f}"),
        ("Total input tokens", f"{metrics.total_input_tokens}"),
        ("Total generated tokens", f"{metrics.total_output_tokens}"),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    for label, stat in (("TTFT", metrics.ttft_ms), ("TPOT", metrics.tpot_ms), ("ITL", metrics.itl_ms),
                        ("E2EL", metrics.e2el_ms)):
        rows += [(f"Mean {label} (ms)", f"{stat.mean:.2f}"), (f"Median {label} (ms)", f"{stat.median:.2f}"),
                 (f"P99 {label} (ms)", f"{stat.p99:.2f}")]
    width = 50
    lines = [f"{f' {title} ':=^{width}}"]
    if metrics.spec_decode is not None:
        spec = metrics.spec_decode
        rows += [("Spec decode drafts", f"{spec['num_drafts']}"),
                 ("Spec decode draft tokens", f"{spec['num_draft_tokens']}"),
                 ("Spec decode accepted tokens", f"{spec['num_accepted_tokens']}"),
                 ("Spec decode acceptance rate", f"{spec['acceptance_rate']:.3f}")]
    lines += [f"{label:<{width - 12}}{value:>12}" for label, value in rows]
    if metrics.usage_missing:
        lines.append(f"note: {metrics.usage_missing} responses had no usage; their chunks were counted")
    lines += [f"error: {e}" for e in metrics.errors]
    lines.append("=" * width)
    return "\n".join(lines)
