"""benchmarks/side_by_side.py's run logic against the fake `core serve`: levels, notes, timeouts, failures."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import side_by_side  # noqa: E402
from peers.common import SetupError  # noqa: E402
from peers.peer import Context, Launch, Peer  # noqa: E402
from peers.report import Row  # noqa: E402


def _server_helpers():
    name = "bench_server_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "server" / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def fake_url():
    helpers = _server_helpers()
    with helpers.run_server(helpers.FAKE, ("--max-model-len", "4096"), env={"CORE_FAKE_STEP_DELAY": "0.002"}) as server:
        yield server.base_url


def plan(**overrides) -> side_by_side.Plan:
    values = {"levels": [1, 4], "input_len": 8, "output_len": 6, "prompts_per_stream": 2, "min_prompts": 3}
    return side_by_side.Plan(**{**values, **overrides})


def test_levels_fill_the_row(fake_url):
    row = Row("fake", "fake")
    launch = Launch(["unused"], model="fake", version="0")
    asyncio.run(side_by_side.measure_levels(fake_url, launch, plan(), row))
    assert set(row.throughput) == {1, 4} and all(v > 0 for v in row.throughput.values())
    assert row.decode_tok_s > 0 and row.ttft_ms > 0 and row.prompt_tokens > 8
    assert row.notes == []


def test_a_slow_level_is_cut_and_noted(fake_url):
    row = Row("fake", "fake")
    launch = Launch(["unused"], model="fake", version="0")
    slow = plan(levels=[1, 4], output_len=400, min_prompts=2, level_timeout_s=0.3)
    with pytest.raises(RuntimeError, match="every request failed"):
        asyncio.run(side_by_side.measure_levels(fake_url, launch, slow, row))
    assert "not done in 0 s; higher levels skipped" in row.notes[0] and 4 not in row.throughput


def test_early_stops_are_noted():
    row = Row("fake", "fake")
    from core.bench.metrics import RequestResult, compute_metrics

    metrics = compute_metrics([RequestResult(True, 5, 3, 0.1, 0.2, [0.05, 0.05])], 1.0)
    side_by_side.check_level(row, 1, 1, 6, metrics)
    assert "3 of 6 tokens" in row.notes[0]


def test_a_peer_that_cannot_be_set_up_is_a_failed_row(tmp_path):
    def broken(ctx: Context) -> Launch:
        raise SetupError("cmake exited 1: no compiler")

    ctx = Context(tmp_path / "model.gguf", convert=lambda: tmp_path, port=1)
    row = side_by_side.run_peer(Peer("broken", "Broken", broken), ctx, plan())
    assert row.status == "failed: cmake exited 1: no compiler" and not row.ok


def test_result_names_carry_commit_and_vendor_and_never_overwrite_an_earlier_run(tmp_path):
    stem = side_by_side.result_stem(tmp_path, "2026-12-03", "993febd", "AuthenticAMD", "")
    assert stem == "side_by_side-2026-12-03-993febd-amd"
    for suffix in (".md", ".json", ".png"):
        (tmp_path / f"{stem}{suffix}").write_text("earlier run")
    assert side_by_side.result_stem(tmp_path, "2026-12-03", "993febd", "AuthenticAMD", "") == f"{stem}-2"
    (tmp_path / f"{stem}-2.md").write_text("second run")
    assert side_by_side.result_stem(tmp_path, "2026-12-03", "993febd", "AuthenticAMD", "") == f"{stem}-3"
    tagged = side_by_side.result_stem(tmp_path, "2026-12-03", "", "GenuineIntel", "avx2-ceiling")
    assert tagged == "side_by_side-2026-12-03-intel-avx2-ceiling"


def test_checkout_commit_names_this_checkout():
    root = Path(side_by_side.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    commit = side_by_side.checkout_commit()
    assert commit and head.startswith(commit)
