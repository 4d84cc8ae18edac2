"""A bfloat16 model's dense weights multiplied by the native kernels on the CPU (``csrc/bf16_linear.c``).

A bf16 checkpoint (most of the Hub's safetensors) served as it is used to multiply through torch:
``F.linear``'s one-row bf16 path reads the weights at 13-23 GB/s on a 2-core Zen 4 EPYC, and on CPUs
without bf16 instructions steps of 6+ rows went through ``layers.matmul.UpcastMatmul``. Each linear layer
and the LM head now keep their weight as a ``NativeWeight`` of 16 bits (the same blocks the packed codes
use, so the native decode stack runs a bf16 model's layers in one call too): on that EPYC (2 threads,
the weights hot in the caches) SmolLM2's 3072x576 gate/up 100 -> 33 us at one row, 119 -> 46 at four,
586 -> 521 at 64, and 0.92-1.02x torch's time at 512 rows (both near the 117 G multiply-adds a second of
``vdpbf16ps`` on a core); the AVX2 loop (two FMAs a pair of inputs) 2.1-11x faster than UpcastMatmul
from 1 to 64 rows, 0.84-1.34x at 512 (``ATEN_CPU_CAPABILITY=avx2``, the same machine).

The arithmetic is the same for every row and batch (float32 sums of bf16 products in a fixed order:
bf16_linear.c); it differs from torch's only in the order of the sums, so outputs are equal or a
bfloat16 rounding apart. Not done: a tensor-parallel rank (its weights are slices the collectives
expect dense), a CPU whose kernels have AMX tiles (oneDNN multiplies bf16 on the tiles there, and a tile
loop for these blocks is not written yet), and weights of other dtypes (float32 and float16 stay with
torch). The embedding table of a tied LM head stays dense for its lookups: the head holds a blocked copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.quantized import packed_linear
from .library import CpuKernels, available
from .packed_weight import NativeWeight


def bfloat16_kernels(device: torch.device, dtype: torch.dtype, sharded: bool) -> CpuKernels | None:
    """The kernels that take a model's bf16 weights, or None where torch keeps them (see the docstring)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or sharded:
        return None
    kernels = available()
    if kernels is None or kernels.uses_amx:
        return None
    return kernels


def pack_bfloat16(model: nn.Module, kernels: CpuKernels) -> int:
    """Replace every dense bf16 weight of a linear layer or LM head by a 16-bit ``NativeWeight``; returns
    how many were replaced."""
    count = 0
    for module in list(model.modules()):
        weight = getattr(module, "weight", None)
        if not hasattr(module, "matmul") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            continue
        packed = NativeWeight.from_bfloat16(weight.detach(), kernels)
        del module.weight  # a tied embedding keeps the parameter under its own name
        module.weight = packed
        module.matmul = packed_linear
        count += 1
    return count
