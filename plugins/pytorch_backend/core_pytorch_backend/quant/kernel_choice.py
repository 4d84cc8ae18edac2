"""Which kernel multiplies packed weights on this CPU, and in which dtype the model runs: measured once.

Two kernels take the codes as they are:

- the plugin's own (``native.NativeWeight``, ``csrc/packed_linear.c``): float32 activations rounded per
  32 inputs in two int8 steps (~1e-4 relative error), float32 results, the same arithmetic whatever the
  batch; the model around it runs in float32. Teacher-forced on the default model it agrees with the
  dequantized float32 model at 99.65-99.9% of positions (``tests/test_quant_accuracy.py``).
- torch's int4 kernel (``layers.quantized.Int4Weight``), fast in bfloat16 only on CPUs with bf16
  instructions (float32 is 40x slower there), and a bfloat16 model agrees at ~97.5%.

Both are timed at one row, a decode step's shape (1536x576, one thread, trials interleaved): the native
kernel is chosen unless it is more than ``NATIVE_MARGIN`` slower than torch's fastest dtype (its accuracy
is worth that much), or where it cannot be built. The choice and the timings are logged.
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
from ..native.packed_weight import NativeWeight
from .affine import quantize_int4

log = logging.getLogger(__name__)
CANDIDATES = (torch.bfloat16, torch.float32)  # float16 activations overflow on some models' hidden states
PROBE_SHAPE = (1536, 576)  # a small model's MLP projection: a decode step's typical matmul
WARMUP_CALLS, TRIALS, CALLS = 60, 7, 3
NATIVE_MARGIN = 1.25


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


def _timings(native: CpuKernels | None) -> dict[str, float]:
    """Best-of-trials microseconds per call for each candidate, the candidates' trials interleaved.

    The first few dozen calls of a fresh process are slow whatever the kernel (seen: 1-5 ms instead of
    20 us), so each candidate is warmed up first; other work on the machine only makes a trial slower,
    so the fastest trial is the one that counts.
    """
    dense = np.random.default_rng(0).standard_normal(PROBE_SHAPE).astype(np.float32)
    codes = quantize_int4(dense)
    probes = {_name(d): (Int4Weight.from_affine(codes, d).linear, torch.randn(1, PROBE_SHAPE[1]).to(d))
              for d in CANDIDATES}
    if native is not None:
        probes["native"] = (NativeWeight.from_affine(codes, native).linear, torch.randn(1, PROBE_SHAPE[1]))
    for linear, x in probes.values():
        for _ in range(WARMUP_CALLS):
            linear(x, None)
    best = dict.fromkeys(probes, float("inf"))
    for _ in range(TRIALS):
        for name, (linear, x) in probes.items():
            best[name] = min(best[name], _trial_us(linear, x))
    return best


def choose(timings: dict[str, float], native: CpuKernels | None) -> PackedKernel:
    """The choice the timings make (see the module docstring)."""
    torch_best = min(CANDIDATES, key=lambda d: timings[_name(d)])
    torch_us = timings[_name(torch_best)]
    if native is not None and timings["native"] <= NATIVE_MARGIN * torch_us:
        return PackedKernel(native, torch.float32)
    return PackedKernel(None, torch_best)


@functools.cache
def packed_kernel() -> PackedKernel:
    """The kernel for packed weights on this CPU and the dtype its models run in (timed at first call)."""
    native = available()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy machine delays a trial, never a barrier of two threads
    try:
        timings = _timings(native)
    finally:
        torch.set_num_threads(threads)
    chosen = choose(timings, native)
    log.info("packed weights: the %s kernel, the model in %s (one row, one thread, %s: %s; CPU capability %s)",
             chosen.name, _name(chosen.dtype), "x".join(map(str, PROBE_SHAPE)),
             ", ".join(f"{name} {us:.0f} us" for name, us in timings.items()),
             torch.backends.cpu.get_cpu_capability())
    return chosen

