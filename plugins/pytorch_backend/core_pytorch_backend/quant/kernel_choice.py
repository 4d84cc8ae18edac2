"""Which dtype the packed CPU kernels multiply in on this CPU, measured once per process.

torch's int4/int8 weight-only kernels take bfloat16, float16 or float32 activations (with scales of the
same dtype), and their speed differs by up to two orders of magnitude between them depending on the
CPU's instructions (on an AVX-512-BF16 EPYC: bf16 31 us, float32 1,260 us on one thread for a 1536x576
weight at one row). A model with packed weights and no dtype named runs in the dtype measured fastest
here (the loader asks once per process, and the choice is logged).
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch

from ..layers.quantized import Int4Weight
from .affine import quantize_int4

log = logging.getLogger(__name__)
CANDIDATES = (torch.bfloat16, torch.float32)  # float16 activations overflow on some models' hidden states
PROBE_SHAPE = (1536, 576)  # a small model's MLP projection: a decode step's typical matmul
WARMUP_CALLS, TRIALS, CALLS = 60, 7, 3


def _trial_us(weight: Int4Weight, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        weight.linear(x, None)
    return (time.perf_counter() - start) / CALLS * 1e6


def _timings() -> dict[torch.dtype, float]:
    """Best-of-trials microseconds per call for each candidate, the candidates' trials interleaved.

    The first few dozen calls of a fresh process are slow whatever the dtype (seen: 1-5 ms instead of
    20 us), so each candidate is warmed up first; other work on the machine only makes a trial slower,
    so the fastest trial is the one that counts.
    """
    dense = np.random.default_rng(0).standard_normal(PROBE_SHAPE).astype(np.float32)
    codes = quantize_int4(dense)
    probes = {d: (Int4Weight.from_affine(codes, d), torch.randn(1, PROBE_SHAPE[1]).to(d)) for d in CANDIDATES}
    for weight, x in probes.values():
        for _ in range(WARMUP_CALLS):
            weight.linear(x, None)
    best = dict.fromkeys(CANDIDATES, float("inf"))
    for _ in range(TRIALS):
        for dtype, (weight, x) in probes.items():
            best[dtype] = min(best[dtype], _trial_us(weight, x))
    return best


@functools.cache
def fastest_packed_dtype() -> torch.dtype:
    """The fastest activation dtype of the int4 kernel at one row on this CPU (timed at first call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy machine delays a trial, never a barrier of two threads
    try:
        timings = _timings()
    finally:
        torch.set_num_threads(threads)
    best = min(timings, key=timings.get)
    log.info("packed weights: the model runs in %s (int4 kernel, one row, one thread, %s: %s; "
             "CPU capability %s)",
             str(best).replace("torch.", ""), "x".join(map(str, PROBE_SHAPE)),
             ", ".join(f"{str(d).replace('torch.', '')} {t:.0f} us" for d, t in timings.items()),
             torch.backends.cpu.get_cpu_capability())
    return best
