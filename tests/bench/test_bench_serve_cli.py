"""`core bench serve --json` end to end against a real `core serve` subprocess on the fake backend."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER_TESTS = Path(__file__).resolve().parents[1] / "server"


def _server_helpers():
    """tests/server/conftest.py's run_server and FAKE spec, loaded by path (no `from conftest import`)."""
    name = "bench_server_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SERVER_TESTS / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    helpers = _server_helpers()
    # the byte tokenizer makes the multi-turn chats ~1,500 tokens long: widen the fake's context
    with helpers.run_server(helpers.FAKE, ("--max-model-len", "4096"), env={"CORE_FAKE_STEP_DELAY": "0.002"}) as server:
        yield server.base_url


def bench(base_url: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "core.cli", "bench", "serve", "--base-url", base_url, "--json", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_fixed_dataset_numbers_are_consistent(fake_server):
    done = bench(fake_server, "--dataset", "fixed", "--num-prompts", "12", "--input-len", "8", "--output-len", "10",
                 "--max-concurrency", "4", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["settings"]["model"] and result["settings"]["request_rate"] == "inf"
    assert (result["completed"], result["failed"]) == (12, 0)
    assert result["total_output_tokens"] == 12 * 10  # ignore_eos: exactly output_len each, from usage
    assert result["usage_missing"] == 0
    assert result["total_input_tokens"] > 12 * 8  # byte tokenizer: more tokens than words
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration_s"])
    assert result["request_throughput"] == pytest.approx(12 / result["duration_s"])
    assert 0 < result["ttft_ms"]["mean"] <= result["e2el_ms"]["mean"]
    assert result["tpot_ms"]["median"] > 0 and result["itl_ms"]["p99"] >= result["itl_ms"]["median"]


def test_multi_turn_chat_with_poisson_arrivals(fake_server):
    done = bench(fake_server, "--dataset", "multi-turn", "--num-prompts", "6", "--output-len", "5",
                 "--request-rate", "50", "--ignore-eos", "--no-progress")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["completed"] == 6 and result["total_output_tokens"] == 30
    assert result["settings"]["request_rate"] == 50.0


def test_text_report_and_progress_bar(fake_server):
    command = [sys.executable, "-m", "core.cli", "bench", "serve", "--base-url", fake_server, "--dataset", "random",
               "--num-prompts", "5", "--input-len", "6", "--output-len", "4", "--ignore-eos"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Successful requests" in done.stdout and "5/5" in done.stderr


def test_unreachable_server_is_a_clear_error():
    done = bench("http://127.0.0.1:9", "--num-prompts", "1", "--model", "m")
    assert done.returncode != 0
    assert "core bench serve: error" in done.stderr and "Traceback" not in done.stderr


def test_bad_extra_body_names_the_flag():
    done = bench("http://127.0.0.1:9", "--extra-body", "[1]")
    assert done.returncode == 2 and "--extra-body must be a JSON object" in done.stderr
