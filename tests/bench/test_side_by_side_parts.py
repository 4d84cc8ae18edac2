"""Pure parts of benchmarks/side_by_side.py: the report tables, the README update, the memory sampler, the
share of the CPUs other work took during a level."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from peers.cpu import CpuTicks, other_work_fraction, process_ticks, ticks_now  # noqa: E402
from peers.process import PeakMemory, descendants  # noqa: E402
from peers.report import README_END, README_START, Row, ratio_table, results_table, update_readme  # noqa: E402

LEVELS = [1, 8]


def rows() -> list[Row]:
    return [Row("core", "core", "1.0", decode_tok_s=50.0, ttft_ms=80.0, throughput={1: 48.0, 8: 300.0},
                peak_pss_mib=1000.0, hwm_sum_mib=1200.0),
            Row("llama-server", "llama.cpp", "b1", decode_tok_s=100.0, ttft_ms=40.0, throughput={1: 96.0, 8: 150.0},
                peak_pss_mib=500.0),
            Row("vllm", "vLLM", status="failed: exited with 1 while starting")]


def test_results_table_has_a_row_per_system_and_shows_failures():
    table = results_table(rows(), LEVELS)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "| core | 1.0 | 50.0 | 80 | 48 | 300 | 1,000 | 1,200 | - |" in table
    assert "| vLLM | - | failed: exited with 1 while starting |" in table
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_ratio_table_divides_core_by_each_peer():
    table = ratio_table(rows(), LEVELS)
    assert "| llama.cpp | 0.50x | 0.50x | 2.00x | 2.00x |" in table
    assert "| vLLM | - | - | - | - |" in table


def test_update_readme_replaces_only_the_marked_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{README_START}\nold table\n{README_END}\nafter\n")
    assert update_readme(readme, "new table")
    assert readme.read_text() == f"# x\nbefore\n{README_START}\nnew table\n{README_END}\nafter\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers")
    assert not update_readme(plain, "t") and plain.read_text() == "no markers"


def test_peak_memory_counts_children():
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'x = bytearray(150 * 2**20); import time; time.sleep(3)']); "
            "time.sleep(3); child.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        memory = PeakMemory(parent.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(descendants(parent.pid)) < 2:
            time.sleep(0.05)
        time.sleep(1.0)
        peak = memory.stop()
    finally:
        parent.kill()
        parent.wait()
    assert 150 < peak < 1024, peak  # the child's 150 MiB buffer, plus both interpreters
    assert memory.hwm_sum_mib >= peak


@pytest.mark.parametrize("pid", [2**22 + 7])
def test_descendants_of_a_missing_process_is_just_itself(pid):
    assert descendants(pid) == {pid}


def test_other_work_is_the_busy_time_the_processes_under_test_did_not_use():
    before = CpuTicks(busy=1_000, total=10_000, ours=300)
    assert other_work_fraction(before, CpuTicks(busy=1_900, total=11_000, ours=1_100)) == pytest.approx(0.1)
    assert other_work_fraction(before, CpuTicks(busy=1_800, total=11_000, ours=1_100)) == 0.0  # never below 0
    assert other_work_fraction(before, None) is None and other_work_fraction(None, before) is None
    assert other_work_fraction(before, before) is None  # no time between the readings


def test_a_busy_process_beside_the_ones_under_test_shows_as_other_work():
    """Real readings: a child spinning on a core is other work unless it is among the processes under test."""
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)  # started
        outside, inside = ticks_now({os.getpid()}), ticks_now({os.getpid(), spinner.pid})
        time.sleep(1.0)
        other_outside = other_work_fraction(outside, ticks_now({os.getpid()}))
        other_inside = other_work_fraction(inside, ticks_now({os.getpid(), spinner.pid}))
        assert process_ticks(spinner.pid) > 0
    finally:
        spinner.kill()
        spinner.wait()
    cores = os.cpu_count() or 1
    assert other_outside is not None and other_inside is not None
    assert other_outside - other_inside > 0.5 / cores  # one core's worth, less the readings' jitter
    assert process_ticks(spinner.pid) == 0  # gone: no ticks, no error
