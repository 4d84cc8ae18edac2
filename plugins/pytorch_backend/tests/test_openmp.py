"""core.openmp: a thread's idle OpenMP workers are freed on request (Linux, libgomp)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")

SCRIPT = textwrap.dedent("""
    import os, threading, time, torch
    from core.openmp import release_openmp_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settled(target):  # freed workers leave /proc a moment after the call returns (seen under load)
        for _ in range(200):
            if threads() <= target:
                break
            time.sleep(0.01)
        return threads()

    torch.set_num_threads(4)  # a pool of 3 workers for each thread that runs a parallel op
    big = torch.randn(4_000_000)
    before = threads()
    (big + big).sum()
    with_pool = threads()
    released = release_openmp_pool()
    print(before, with_pool, settled(before), released)

    def worker():  # another thread builds its own pool and frees it the same way
        (big * 2).sum()
        in_thread = threads()
        print(in_thread, release_openmp_pool(), settled(in_thread - 3))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
""")


def test_release_frees_the_calling_threads_pool():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "4"}).stdout.split("\n")
    before, with_pool, after, released = out[0].split()
    if released != "True":
        pytest.skip("this torch build's OpenMP runtime has no omp_pause_resource_all")
    assert int(with_pool) == int(before) + 3
    assert int(after) == int(before)
    in_thread, released_there, after_thread = out[1].split()
    assert released_there == "True"
    assert int(after_thread) == int(in_thread) - 3


def test_release_without_a_runtime_is_harmless():
    code = "from core.openmp import release_openmp_pool; import sys; print(release_openmp_pool(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
