"""Metrics math: percentiles, per-request TPOT, and the aggregate numbers of a run."""

from __future__ import annotations

import math

import pytest

from core.bench.metrics import RequestResult, Stat, compute_metrics, format_report, percentile


def test_percentile_interpolates_like_numpy():
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 99) == pytest.approx(4 + 0.96 * 6)  # position 3.96
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("q", [-1, 101])
def test_percentile_rejects_bad_q(q):
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], q)


def test_stat_is_in_milliseconds_and_empty_is_nan():
    stat = Stat.of_seconds([0.1, 0.2, 0.3])
    assert stat.mean == pytest.approx(200.0)
    assert stat.median == pytest.approx(200.0)
    assert stat.p99 == pytest.approx(298.0)
    assert stat.std == pytest.approx(math.sqrt(2 / 3) * 100)
    assert math.isnan(Stat.of_seconds([]).mean)


def test_tpot_excludes_the_first_token():
    assert RequestResult(True, output_tokens=11, ttft=0.5, latency=1.5).tpot == pytest.approx(0.1)
    assert RequestResult(True, output_tokens=1, ttft=0.5, latency=0.5).tpot is None


def test_compute_metrics_aggregates_successes_only():
    results = [
        RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(False, error="HTTP 500: boom"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.tpot_ms.mean == pytest.approx((100.0 + 200.0) / 2)
    assert m.itl_ms.median == pytest.approx(100.0)
    assert m.e2el_ms.p99 == pytest.approx(698.0)
    assert m.errors == ("HTTP 500: boom",)


def test_compute_metrics_rejects_a_non_positive_duration():
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], 0.0)


def test_report_names_every_metric():
    m = compute_metrics([RequestResult(True, 4, 2, 0.1, 0.2, [0.1], usage_reported=False)], 1.0)
    text = format_report(m)
    for label in ("Successful requests", "Output token throughput", "Mean TTFT", "P99 TPOT", "Median ITL",
                  "Mean E2EL", "had no usage"):
        assert label in text
