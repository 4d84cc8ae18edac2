"""Release the calling thread's idle OpenMP workers, so that the engine thread's workers keep spinning.

Torch's CPU kernels run on OpenMP (libgomp in the Linux wheels). Every thread that runs a parallel torch
op becomes the master of its own pool of worker threads, and that pool lives as long as the thread. When
libgomp manages more threads than there are CPUs, it throttles spinning: between two parallel regions
its workers sleep on a futex instead of spinning, and every op pays the wake-up. Loading a model on the
main thread and then decoding on the engine thread leaves exactly that: the main thread's idle pool plus
the engine's. On a 2-core machine a SmolLM2 decode step took 56 ms on the engine thread against 35 ms
on the main thread (`benchmarks/engine_thread_overhead.py`); with the main thread's pool released, both
take 34 ms.

So a thread that has finished its torch work (loading, a vision encode) calls `release_openmp_pool()`.
The standard OpenMP 5.0 call `omp_pause_resource_all(omp_pause_soft)` frees the calling thread's pool;
the next parallel op on that thread builds a new one. No torch import: the runtime is looked up among the
libraries already loaded, and nothing happens when there is none.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)
OMP_PAUSE_SOFT = 1


_found: list[Callable[[int], int]] = []  # the runtime's function once found (torch may load after this module)


def _pause_resource_all() -> Callable[[int], int] | None:
    if not _found:
        try:
            function = ctypes.CDLL(None).omp_pause_resource_all
        except (AttributeError, OSError):  # no OpenMP runtime loaded, or one older than OpenMP 5.0
            return None
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        _found.append(function)
    return _found[0]


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; True when a runtime did it.

    Call it on a thread that ran torch ops and will not run more soon, never inside a parallel region.
    """
    pause = _pause_resource_all()
    if pause is None:
        return False
    released = pause(OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("omp_pause_resource_all refused to release this thread's OpenMP pool")
    return released
