"""A short soak (benchmarks/soak.py) in the default run: two identical rounds of mixed concurrent
requests with client aborts and sleep/wakeup under load, on the fake backend and the tiny Llama.
`nox -s soak` runs the long one on the default model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import FAKE, SERVER_SPECS, TINY_LLAMA, ServerSpec, resolve_spec

SOAK_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    """benchmarks/soak.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("core_benchmarks_soak", SOAK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("spec", SERVER_SPECS, ids=lambda spec: spec.name)
def test_short_soak(spec: ServerSpec, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture) -> None:
    soak = load_soak()
    spec = resolve_spec(spec, request)
    backend = ("--backend", spec.backend) if spec.backend else ()
    options = soak.SoakOptions(model=spec.model, serve_args=(*backend, *spec.args),
                               env={"CORE_EXTRA_PLUGINS": "fake_backend_plugin",
                                    "PYTHONPATH": str(Path(__file__).parent), **spec.env},
                               rounds=2, requests=60, concurrency=6, max_tokens=16, quiet=True)
    report = soak.soak(options)
    with capsys.disabled():
        print(f"\nsoak on {spec.name}:")
        for number, figures in enumerate(report.rounds, 1):
            soak.print_round(number, figures)
    assert not report.failures, "\n".join(report.failures)
    assert len(report.rounds) == 2
    for figures in report.rounds:
        outcomes = {outcome for _, outcome in figures.outcomes}
        assert {"200", "client abort"} <= outcomes, figures.outcomes
        assert [action for action, _ in figures.transitions] == ["sleep 1", "wakeup", "sleep 2", "wakeup"]


def test_soak_flags_problems(request: pytest.FixtureRequest) -> None:
    """The soak's own checks catch a stop string left in a text and a stream missing its [DONE]."""
    soak = load_soak()
    planned = soak.Planned("/v1/completions", {"stream": True, "stop": ["e"]}, choices=1)
    body = 'data: {"choices":[{"index":0,"text":"hello","finish_reason":"stop"}]}\n\n'
    outcome = soak._check_stream(planned, body, complete=True)
    assert any("no [DONE]" in p for p in outcome.problems)
    assert any("stop string" in p for p in outcome.problems)
    assert FAKE in SERVER_SPECS and TINY_LLAMA in SERVER_SPECS


def rss_rounds(soak, mib: list[int]) -> list:
    return [soak.RoundFigures(rss_after_kib=value * 1024) for value in mib]


@pytest.mark.parametrize("mib", [[548, 573, 552, 554, 551, 579, 589, 569],  # measured: a plateau
                                 [508, 560, 585, 550, 571, 566, 559, 570],  # one high round early on
                                 [500, 540], [500]])
def test_the_rss_bar_passes_a_heap_that_wanders_around_its_plateau(mib: list[int]) -> None:
    soak = load_soak()
    assert soak.rss_problems(rss_rounds(soak, mib)) == []


@pytest.mark.parametrize("mib", [[500, 520, 540, 560, 580, 600, 620, 640],  # 20 MiB a round
                                 [500, 560], [500, 505, 600, 610]])
def test_the_rss_bar_fails_memory_that_keeps_growing(mib: list[int]) -> None:
    soak = load_soak()
    problems = soak.rss_problems(rss_rounds(soak, mib))
    assert len(problems) == 1 and "more than 10%" in problems[0], problems
