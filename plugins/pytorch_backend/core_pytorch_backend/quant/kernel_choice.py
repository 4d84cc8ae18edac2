"""Which kernel multiplies packed weights on this CPU, and in which dtype the model runs.

Two kernels take the codes as they are:

- the plugin's own (``native.NativeWeight``, ``csrc/packed_linear.c``): float32 activations rounded per
  32 inputs in two int8 steps (~1e-4 relative error), float32 results, the same arithmetic whatever the
  batch; the model around it runs in float32. Teacher-forced on the default model it agrees with the
  dequantized float32 model at 99.65-99.9% of positions (``tests/test_quant_accuracy.py``).
- torch's int4 kernel (``layers.quantized.Int4Weight``), fast in bfloat16 only on CPUs with bf16
  instructions (float32 is 40x slower there), and a bfloat16 model agrees at ~97.5%.

The native kernel serves wherever it builds (its variant chosen from the CPU's flags: ``native.build``):
it alone meets the accuracy bar (99%), it is what the native decode stack runs, and the choice must not
change from one start to the next (the two kernels' outputs differ, so a timed choice made the same
greedy request give different text after a restart). Only where it cannot be built (no C compiler)
does torch's kernel run, in its faster dtype, timed at one row of 1536x576 on one thread; the choice
and the reason are logged.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.quantized import Int4Weight
from ..native.library import CpuKernels, available
from .affine import quantize_int4

log = logging.getLogger(__name__)
CANDIDATES = (torch.bfloat16, torch.float32)  # float16 activations overflow on some models' hidden states
PROBE_SHAPE = (1536, 576)  # a small model's MLP projection: a decode step's typical matmul
WARMUP_CALLS, TRIALS, CALLS = 60, 7, 3


@dataclass(frozen=True)
class PackedKernel:
    """What multiplies packed weights: ``native`` (the plugin's kernels; None: torch's int4 kernel) and
    the dtype a model with packed weights runs in when none is named."""

    native: CpuKernels | None
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"native {self.native.variant}" if self.native is not None else "torch int4"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _trial_us(linear, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        linear(x, None)
    return (time.perf_counter() - start) / CALLS * 1e6


def _torch_timings() -> dict[str, float]:
    """Best-of-trials microseconds per call of torch's int4 kernel in each candidate dtype, the trials
    interleaved.

    The first few dozen calls of a fresh process are slow whatever the kernel (seen: 1-5 ms instead of
    20 us), so each candidate is warmed up first; other work on the machine only makes a trial slower,
    so the fastest trial is the one that counts.
    """
    dense = np.random.default_rng(0).standard_normal(PROBE_SHAPE).astype(np.float32)
    codes = quantize_int4(dense)
    probes = {_name(d): (Int4Weight.from_affine(codes, d).linear, torch.randn(1, PROBE_SHAPE[1]).to(d))
              for d in CANDIDATES}
    for linear, x in probes.values():
        for _ in range(WARMUP_CALLS):
            linear(x, None)
    best = dict.fromkeys(probes, float("inf"))
    for _ in range(TRIALS):
        for name, (linear, x) in probes.items():
            best[name] = min(best[name], _trial_us(linear, x))
    return best


def choose(native: CpuKernels | None, torch_timings: dict[str, float] | None = None) -> PackedKernel:
    """The native kernels with the model in float32 where they built; else torch's int4 kernel in the dtype
    ``torch_timings`` found fastest (see the module docstring)."""
    if native is not None:
        return PackedKernel(native, torch.float32)
    if torch_timings is None:
        raise ValueError("torch_timings are needed when the native kernels are unavailable")
    return PackedKernel(None, min(CANDIDATES, key=lambda d: torch_timings[_name(d)]))


@functools.cache
def packed_kernel() -> PackedKernel:
    """The kernel for packed weights on this CPU and the dtype its models run in (chosen at first call)."""
    native = available()
    if native is not None:
        chosen = choose(native)
        log.info("packed weights: the %s kernel, the model in float32 (the kernel that meets the accuracy "
                 "bar; CPU capability %s)", chosen.name, torch.backends.cpu.get_cpu_capability())
        return chosen
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy machine delays a trial, never a barrier of two threads
    try:
        timings = _torch_timings()
    finally:
        torch.set_num_threads(threads)
    chosen = choose(None, timings)
    log.info("packed weights: the %s kernel (the native kernels are unavailable), the model in %s (one row, "
             "one thread, %s: %s; CPU capability %s)", chosen.name, _name(chosen.dtype),
             "x".join(map(str, PROBE_SHAPE)), ", ".join(f"{name} {us:.0f} us" for name, us in timings.items()),
             torch.backends.cpu.get_cpu_capability())
    return chosen
