"""A peer's process: started in its own process group, its peak memory sampled, stopped without leftovers.

Memory is sampled every 0.2 s over the process and all its descendants (vLLM, for one, does its work in
a child process), two ways:
- peak PSS: the largest sum over the live processes of their proportional set size (smaps_rollup), which
  shares each shared page among the processes that map it: the tree's real footprint, as sampled;
- sum of VmHWM: each process's kernel-kept high-water mark of resident memory, added up over every
  process ever seen: an upper bound (shared pages and short-lived helpers count in full).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from peers.common import SetupError, log_dir, log_tail

SAMPLE_INTERVAL_S = 0.2


def descendants(root: int) -> set[int]:
    """`root` and every live process below it, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = {root}, [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _field_kib(path: str, name: str) -> int:
    """One `Name:   123 kB` field of a /proc file, in KiB (0 if the process is gone)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def high_water_kib(pid: int) -> int:
    """VmHWM (peak resident memory) of one process in KiB."""
    return _field_kib(f"/proc/{pid}/status", "VmHWM:")


def pss_kib(pid: int) -> int:
    """Proportional set size of one process in KiB."""
    return _field_kib(f"/proc/{pid}/smaps_rollup", "Pss:")


class PeakMemory:
    """Samples the process tree under a pid on a thread: `peak_pss_mib` and `hwm_sum_mib` (see above)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._peaks: dict[int, int] = {}
        self._peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_INTERVAL_S)

    def sample(self) -> None:
        live = descendants(self.pid)
        for pid in live:
            self._peaks[pid] = max(self._peaks.get(pid, 0), high_water_kib(pid))
        self._peak_pss = max(self._peak_pss, sum(pss_kib(pid) for pid in live))

    def stop(self) -> float:
        """Stop sampling; returns `peak_pss_mib`."""
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_pss_mib

    @property
    def peak_pss_mib(self) -> float:
        return self._peak_pss / 1024

    @property
    def hwm_sum_mib(self) -> float:
        return sum(self._peaks.values()) / 1024


class PeerProcess:
    """One peer's server (or offline script), with its log under the cache's logs/ folder."""

    def __init__(self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None):
        self.name, self.command = name, [str(c) for c in command]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_dir() / f"run-{name}.log"
        self.process: subprocess.Popen | None = None
        self.memory: PeakMemory | None = None
        self.started_at = 0.0

    def start(self) -> PeerProcess:
        print(f"[bench] starting {self.name}: {' '.join(self.command)}  (log: {self.log_path})", flush=True)
        log = self.log_path.open("w")
        self.started_at = time.monotonic()
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        except OSError as exc:
            raise SetupError(f"cannot start {self.command[0]}: {exc}") from exc
        finally:
            log.close()
        self.memory = PeakMemory(self.process.pid)
        return self

    @property
    def pid(self) -> int | None:
        """The process's id once started."""
        return self.process.pid if self.process else None

    def wait_ready(self, url: str, timeout_s: float) -> float:
        """Poll `url` until it answers 200; returns the seconds since start. Raises SetupError with the log."""
        assert self.process is not None, "start() first"
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SetupError(f"exited with {self.process.returncode} while starting: {log_tail(self.log_path)}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SetupError(f"not ready after {timeout_s:.0f} s: {log_tail(self.log_path)}")

    def wait(self, timeout_s: float) -> int:
        """Wait for an offline script to finish (killed after `timeout_s`)."""
        assert self.process is not None, "start() first"
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise SetupError(f"did not finish in {timeout_s:.0f} s") from None

    def stop(self) -> float:
        """Stop the whole process group (SIGINT, then SIGKILL); returns the peak PSS in MiB."""
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.process is not None:
            self._signal(signal.SIGKILL)  # children that outlived the leader
        return self.memory.stop() if self.memory else 0.0

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # type: ignore[union-attr]
        except (ProcessLookupError, PermissionError):
            pass
