"""Dense 16-bit float weights multiplied by the native kernels on the CPU (``csrc/half_linear.c``).

Two kinds of model keep their linear layers' and LM head's weights as 16-bit ``NativeWeight`` blocks (so
that the native decode stack runs their layers in one call too):

- **a bfloat16 model** (most of the Hub's safetensors, served as they are): bf16 products summed in
  float32 (``vdpbf16ps``'s arithmetic). torch's one-row bf16 GEMV read the weights at 13-23 GB/s on a 2-core
  Zen 4 EPYC, and CPUs without bf16 instructions multiplied steps of 6+ rows through
  ``layers.matmul.UpcastMatmul``. On that EPYC (2 threads, the weights hot in the caches) SmolLM2's
  3072x576 gate/up 100 -> 33 us at one row, 119 -> 46 at four, 586 -> 521 at 64, and 0.92-1.02x torch's
  time at 512 rows (both near the 117 G multiply-adds a second of ``vdpbf16ps`` on a core); the AVX2 loop
  (two FMAs a pair of inputs) 2.1-11x faster than UpcastMatmul from 1 to 64 rows, 0.84-1.34x at 512
  (``ATEN_CPU_CAPABILITY=avx2``, the same machine). Not on a CPU whose kernels have AMX tiles: oneDNN
  multiplies bf16 on the tiles there, and a tile loop over these blocks is not written yet.
- **a float32 model from a GGUF file with F16 / BF16 tensors**: each such 2-D tensor arrives as a
  ``HalfWeight`` (``keep_sixteen_bit``) and is packed as it is, never copied into a float32 parameter
  (the default model's F16 file, ``core serve`` on a 2-core Zen 5 EPYC, warm cache: start to healthy
  2.9-3.3 -> 1.9-2.0 s, peak RSS 1,086 -> 842-854 MiB); a float32 weight
  whose every value a 16-bit float holds exactly is kept in that format too (``pack_exact_halves``). Half
  the bytes a one-row step reads, multiplied by float32 FMAs of the exact values, input by input: the
  float32 model's products, only the order of the sums fixed (float32 checkpoints and ``--dtype float32``
  of other checkpoints keep torch's GEMMs, which transformers' ``generate`` runs too).

Either way the arithmetic is the same for every row and batch. Not done: a tensor-parallel rank (its
weights are slices the collectives expect dense) and float16 models. An embedding table tied to the LM
head looks its rows up in the head's blocks (``NativeWeight.rows``), so the model holds one copy: for
the default model's F16 file, 57 MiB of float16 instead of that and a 113 MiB float32 table.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..layers.embedding import VocabEmbedding
from ..layers.quantized import packed_linear
from .library import CpuKernels, available
from .packed_weight import NativeWeight

HALF_DTYPES = (torch.bfloat16, torch.float16)


def half_kernels(device: torch.device, dtype: torch.dtype, sharded: bool, from_gguf: bool) -> CpuKernels | None:
    """The kernels that take a ``dtype`` model's 16-bit weights (a float32 model's only when it comes from a
    GGUF file), or None where torch keeps them (see the module docstring)."""
    if device.type != "cpu" or sharded or not (dtype == torch.bfloat16 or dtype == torch.float32 and from_gguf):
        return None
    kernels = available()
    if kernels is None or (dtype == torch.bfloat16 and kernels.uses_amx):
        return None
    return kernels


@dataclass(frozen=True)
class HalfWeight:
    """A 2-D bfloat16 or float16 tensor of a checkpoint that a float32 model keeps as it is: the model's
    ``load_weights`` hands it back unloaded (as it does an ``AffineWeight``) and ``quant.attach`` packs it."""

    values: torch.Tensor

    def dequantize(self) -> np.ndarray:
        """The float32 values (exact): for a layer that stays dense."""
        return self.values.float().numpy()

    @staticmethod
    def concat(parts: list[HalfWeight]) -> HalfWeight | None:
        """The shards of a fused layer stacked in order, or None when their dtypes differ."""
        if len({part.values.dtype for part in parts}) != 1:
            return None
        return HalfWeight(torch.cat([part.values for part in parts]))


def keep_sixteen_bit(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """``weights`` with each 2-D bfloat16 / float16 tensor as a ``HalfWeight`` (a float32 model's GGUF
    tensors that ``half_kernels`` packs as they are)."""
    for name, value in weights:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.dtype in HALF_DTYPES:
            value = HalfWeight(value)
        yield name, value


def pack_bfloat16(model: nn.Module, kernels: CpuKernels) -> int:
    """Every bf16 weight of a linear layer or LM head as a 16-bit ``NativeWeight``; returns how many."""
    return _pack(model, kernels, lambda weight: torch.bfloat16 if weight.dtype == torch.bfloat16 else None)


def pack_exact_halves(model: nn.Module, kernels: CpuKernels) -> int:
    """Every float32 weight of a linear layer or LM head that bfloat16 or float16 holds exactly, in that
    format (bfloat16 where both do); returns how many."""
    def exact(weight: torch.Tensor) -> torch.dtype | None:
        if weight.dtype != torch.float32:
            return None
        return next((d for d in HALF_DTYPES if torch.equal(weight.to(d).float(), weight)), None)

    return _pack(model, kernels, exact)


def _pack(model: nn.Module, kernels: CpuKernels, format_of) -> int:
    count = 0
    modules = list(model.modules())
    tables = [m for m in modules if isinstance(m, VocabEmbedding)]
    for module in modules:
        weight = getattr(module, "weight", None)
        if not hasattr(module, "matmul") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() != 2 or weight.device.type != "cpu" or (half := format_of(weight.detach())) is None:
            continue
        tied = [t for t in tables if t.weight is weight]
        pack_linear(module, weight.detach().to(half), kernels, tied, weight.dtype)
        count += 1
    return count


def pack_linear(module: nn.Module, values: torch.Tensor, kernels: CpuKernels, tied: list[VocabEmbedding],
                table_dtype: torch.dtype) -> None:
    """Replace ``module``'s weight (a linear layer's or an LM head's) by ``values`` (2-D, 16-bit) as a
    ``NativeWeight``; the embedding tables in ``tied`` (tied to that weight) look their rows up in its
    blocks, as ``table_dtype`` (no second copy)."""
    packed = NativeWeight.from_half(values, kernels)
    for table in tied:
        del table.weight
        table.weight = packed
        table.lookup = functools.partial(half_embedding, dtype=table_dtype)
    del module.weight
    module.weight = packed
    module.matmul = packed_linear


def half_embedding(ids: torch.Tensor, weight: NativeWeight, *, dtype: torch.dtype) -> torch.Tensor:
    """The ``lookup`` of an embedding tied to a 16-bit ``NativeWeight`` (``F.embedding``'s arguments), its
    rows as ``dtype`` (the table's dtype before: the same values)."""
    return weight.rows(ids, dtype)
