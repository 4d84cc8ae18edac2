"""Stopping an engine step between two layers when nobody will read what it computes.

The loop runs commands between steps, and one step of long prefill chunks takes seconds on a CPU (2,048
tokens of the default 135M model: 3-7 s on a 2-core EPYC), so an abort waited for the step in flight: a
sleep under load took that long before it freed anything. When every request of the forward pass in
flight has an abort queued (a sleep, a shutdown, ``/abort {"all": true}``, clients leaving), its work is
thrown away anyway: the next attention layer raises `StepInterrupted`, the loop drops the step, and the
queued aborts run at once.

Dropping a step partway is safe only then: its KV writes land in the aborted sequences' own blocks (a
block joins the prefix cache once the step that filled it completes), and a recurrent layer's states,
advanced partway, belong to sequences that end. An embedding request in the step does not keep it from
being dropped (its chunk is computed again next step, as `_isolate_failure` runs chunks again), unless the
model has recurrent state. Under tensor parallelism every rank must run each step to its end together,
so there the backend makes no `StepInterrupt`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Collection, Iterable, Iterator


class StepInterrupted(Exception):
    """Raised inside a forward pass whose requests all have an abort queued."""


class StepInterrupt:
    """The aborts queued and not yet run, and the forward pass in flight. The threads that queue aborts call
    `aborting` first; the loop thread runs each abort then calls `aborted`, and marks each forward pass with
    `step`; an attention layer calls `check` before it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.Counter[str] = collections.Counter()  # session ids with an abort queued
        self._pending_all = 0  # queued commands that abort every request (sleep, shutdown)
        self._owners: frozenset[str] | None = None  # the forward pass in flight: requests it may not drop
        self._stop = False

    def aborting(self, session_ids: Collection[str] | None) -> None:
        """An abort of `session_ids` (None: of every request) is about to be queued."""
        with self._lock:
            if session_ids is None:
                self._pending_all += 1
            else:
                self._pending.update(session_ids)
            self._stop = self._stop or self._covered()

    def aborted(self, session_ids: Collection[str] | None) -> None:
        """That abort ran (on the loop thread, between steps)."""
        with self._lock:
            if session_ids is None:
                self._pending_all -= 1
            else:
                self._pending.subtract(session_ids)
                self._pending = +self._pending  # (drops the ids at zero)

    @contextlib.contextmanager
    def step(self, owners: Iterable[str]) -> Iterator[None]:
        """Around one forward pass; `owners`: the session ids of the requests whose work it may not drop
        unless they are aborted (none: only an abort of every request stops it)."""
        with self._lock:
            self._owners = frozenset(owners)
            self._stop = self._covered()
        try:
            yield
        finally:
            with self._lock:
                self._owners, self._stop = None, False

    def check(self) -> None:
        """Raise StepInterrupted when every request of the forward pass in flight has an abort queued."""
        if self._stop:
            raise StepInterrupted("the step's requests are being aborted")

    def _covered(self) -> bool:
        if self._owners is None:
            return False
        return self._pending_all > 0 or (bool(self._owners) and all(self._pending[o] > 0 for o in self._owners))
