"""When requests are sent: seeded Poisson (or gamma, for burstier) arrivals, or all at once.

With rate r requests/s and burstiness 1 the gaps are exponential with mean 1/r (a Poisson process);
burstiness b draws gaps from a gamma distribution of shape b and the same mean, so b < 1 is burstier and
b > 1 more regular (vLLM's `--burstiness`). A rate of infinity sends every request at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def arrival_gaps(count: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """`count` waits in seconds, the first before the first request (0 for it, as in vLLM)."""
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    if not rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    rng = random.Random(seed)
    for i in range(count):
        if i == 0 or math.isinf(rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_times(count: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the running sum of `arrival_gaps`."""
    times, now = [], 0.0
    for gap in arrival_gaps(count, rate, burstiness=burstiness, seed=seed):
        now += gap
        times.append(now)
    return times
