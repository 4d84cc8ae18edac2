"""The spawned ranks' processes and the thread that watches them.

Each rank > 0 is a fresh interpreter running `worker.main` (its `WorkerSpec` pickled on stdin),
torchrun-style: unlike multiprocessing's spawn it never re-imports the
parent's ``__main__``, so a script without a ``__main__`` guard, a notebook or pytest can start one.

A rank that exits while the engine runs is a failure of the whole engine: the supervisor records it
once, as a `BackendError` naming the rank and its exit status, and kills the other ranks, so that a
collective rank 0 is waiting in fails at once (their sockets close) instead of at its timeout. From then
on every call of the runner raises that error, the backend's health check fails (/health answers 503)
and the server exits non-zero.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence

from core.errors import BackendError

from .worker import WorkerSpec

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.2
WORKER_COMMAND = "from core_pytorch_backend.distributed.worker import main; main()"


class RankProcesses:
    """Ranks 1..N-1 as child processes, watched by a thread (see the module docstring)."""

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        self.world = len(specs) + 1
        self.processes = {spec.rank: _spawn(spec) for spec in specs}
        self.failure: BackendError | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="core-tp-supervisor", daemon=True)
        self._watcher.start()

    @property
    def alive(self) -> list[int]:
        """The ranks whose process is still running."""
        return [rank for rank, process in self.processes.items() if process.poll() is None]

    def check(self) -> None:
        """Raise the recorded failure, if any."""
        if self.failure is not None:
            raise self.failure

    def fail(self, reason: str) -> BackendError:
        """Record `reason` as the engine's failure (the first one wins), stop every rank, return it."""
        with self._lock:
            if self.failure is None:
                log.critical("tensor parallelism failed: %s", reason)
                self.failure = BackendError(f"{reason}; the engine's ranks are stopped (restart the server)")
        self._kill_all()
        return self.failure

    def wait_for_death(self, timeout: float) -> BackendError | None:
        """The failure the watcher records within `timeout` seconds (a collective that failed just
        before the watcher saw its peer exit), else None."""
        if self.failure is None:
            self._watcher.join(timeout)  # it returns once it has recorded a death
        return self.failure

    def expect_exit(self) -> None:
        """The ranks are about to be told to stop: their exits are no failure."""
        self._stopping.set()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait up to `timeout` seconds for the ranks to exit (they were told to), then kill what is left."""
        self._stopping.set()
        for process in self.processes.values():
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                break
        self._kill_all()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    self.fail(f"tensor-parallel rank {rank} of {self.world} died (exit status {code})")
                    return

    def _kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel rank process %d did not exit after SIGKILL", process.pid)


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    """A fresh interpreter running rank `spec.rank`, with this process's import path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    process = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND], stdin=subprocess.PIPE, env=env)
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(spec))
    process.stdin.close()
    return process
