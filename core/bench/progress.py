"""A progress bar for benchmark runs: tqdm when it is installed, else a plain one on stderr."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """`desc: done/total [elapsed]`, redrawn in place on a terminal, at most ten times a second."""

    def __init__(self, total: int, desc: str, stream: TextIO | None = None):
        self.total, self.desc, self.done = total, desc, 0
        self.stream = stream or sys.stderr
        self._start = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.stream.write(f"\r{self.desc}: [{'#' * filled}{'.' * (width - filled)}] "
                          f"{self.done}/{self.total} [{now - self._start:.1f} s]")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()


class NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, desc: str = "requests", enabled: bool = True) -> Progress:
    """The best available progress bar (or none when disabled)."""
    if not enabled:
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
