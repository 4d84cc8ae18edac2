"""`core bench` and speculative decoding: the repeat dataset, the counters read from /metrics or the
engine's stats, and the report rows they give."""

from __future__ import annotations

import dataclasses

from core.backend import BackendStats
from core.bench import spec_decode
from core.bench.datasets import build_requests
from core.bench.metrics import RequestResult, compute_metrics, format_report
from core.server.metrics import Metrics
from core.speculative import SpecDecodeStats


def test_repeat_requests_ask_to_repeat_a_passage_of_about_input_len_words():
    requests = build_requests("repeat", num_prompts=5, input_len=50, output_len=70, seed=1)
    assert len(requests) == 5 and all(r.is_chat and r.output_len == 70 for r in requests)
    for r in requests:
        instruction, passage = r.messages[0]["content"].split("\n\n")
        assert instruction.endswith(":") and 50 <= len(passage.split()) < 80
    assert build_requests("repeat", num_prompts=5, input_len=50, output_len=70, seed=1) == requests


def test_counters_come_from_a_scrape_of_our_metrics_page():
    stats = SpecDecodeStats()
    stats.record(4, 3)
    text = Metrics().render(BackendStats(spec_decode=stats), "m")
    counts = spec_decode.parse_metrics(text)
    assert counts == spec_decode.SpecDecodeCounts(1, 4, 3)
    assert spec_decode.parse_metrics(Metrics().render(BackendStats(), "m")) is None
    later = spec_decode.SpecDecodeCounts(3, 12, 6)
    assert spec_decode.difference(counts, later).record() == {
        "num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3, "acceptance_rate": 3 / 8}
    assert spec_decode.difference(None, None) is None
    assert spec_decode.from_stats(BackendStats(spec_decode=stats)) == counts


def test_the_report_shows_the_acceptance_rate_only_when_there_is_one():
    metrics = compute_metrics([RequestResult(True, prompt_tokens=3, output_tokens=4, ttft=0.1, latency=0.5,
                                             itl=[0.1, 0.1, 0.2])], 1.0)
    assert "Spec decode" not in format_report(metrics)
    counts = spec_decode.SpecDecodeCounts(2, 8, 6).record()
    report = format_report(dataclasses.replace(metrics, spec_decode=counts))
    assert "Spec decode acceptance rate" in report and "0.750" in report
