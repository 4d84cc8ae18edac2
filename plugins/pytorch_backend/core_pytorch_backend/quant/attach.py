"""Put quantized weights into a built model: packed where a kernel takes them, dense where none does.

Two ways in: ``attach_quantized`` for tensors that arrive quantized (a GGUF file's block-quantized
tensors, as ``AffineWeight``: ``gguf_blocks``; also a float32 model's 16-bit GGUF tensors, as
``HalfWeight``: ``native.half_weights``), and ``quantize_model`` for a float checkpoint quantized at load
(``--quantization int8|int4``). Either way a layer's dense parameter is replaced by a packed module
(``layers.quantized`` or ``native.packed_weight``) and its ``matmul`` (or an embedding's ``lookup``) by
the packed version; the loader says which kernel (``quant.kernel_choice``) and dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.quantized import (
    DENSE_MIN_ROWS,
    AffineRows,
    Int4Weight,
    affine_embedding,
    int4_fits,
    int4_packable,
    packed_linear,
)
from ..native.half_weights import HalfWeight, pack_linear
from ..native.library import CpuKernels
from ..native.packed_weight import NativeWeight, native_fits
from .affine import AffineWeight, quantize_int4, quantize_int8

log = logging.getLogger(__name__)
MODES = ("int8", "int4")
GROUP_SIZE = 32  # inputs per scale of the codes made at load


# parameter name -> shard name (None for an unfused parameter) -> codes: what a model's load_weights
# returns for the tensors that arrived quantized (or 16-bit, to be kept so)
QuantizedShards = dict[str, dict[str | None, AffineWeight | HalfWeight]]


def attach_quantized(model: nn.Module, quantized: QuantizedShards, kernel_dtype: torch.dtype,
                     native: CpuKernels | None, halves: CpuKernels | None = None) -> None:
    """Keep each layer's quantized tensors packed: multiplied by the ``native`` kernels where given, else
    by torch's int4 kernel in ``kernel_dtype``; and its ``HalfWeight`` tensors as 16-bit blocks of the
    ``halves`` kernels (``native.half_weights``). Each entry is let go once attached (``quantized`` is
    emptied), so that a tensor's staging copy is freed as its layer is packed."""
    lm_head = getattr(model, "lm_head", None)
    tied_head = lm_head if isinstance(lm_head, LMHead) and lm_head.tied else None
    while quantized:
        target, shards = quantized.popitem()
        module_name, param_name = target.rsplit(".", 1)
        module = model.get_submodule(module_name)
        dtype = getattr(module, param_name).dtype
        names = getattr(module, "shard_names", [None])
        weight = _whole(shards, names) if param_name == "weight" else None
        if weight is None:  # partly dense, or shards of different kinds: the layer stays dense
            _load_dense(module, param_name, shards)
        elif isinstance(weight, HalfWeight):
            _attach_half(module, weight, dtype, halves, tied_head)
        else:
            _attach(module, weight, dtype, kernel_dtype, native)
            if isinstance(module, VocabEmbedding) and tied_head is not None:
                _attach(tied_head, weight, dtype, kernel_dtype, native)  # the tied LM head multiplies by the same codes


#: while ``attaching_as_loaded``: attaches one entry of a model's quantized shards
_ATTACH_NOW: ContextVar[Callable[[QuantizedShards], None] | None] = ContextVar("attach_now", default=None)


@contextmanager
def attaching_as_loaded(model: nn.Module, kernel_dtype: torch.dtype, native: CpuKernels | None,
                        halves: CpuKernels | None = None) -> Iterator[None]:
    """Within the block, a model's ``load_weights`` attaches each parameter's quantized shards
    (``attach_quantized``) as soon as the last of them arrives (``attach_when_complete``), instead of
    returning them all at the end: a file's unpacked codes (a byte a weight, whatever its bits) are then never
    all staged at once, only a layer's (a Q4_K_M MoE file of 545 MB peaked at 2.06 GB of RSS while loading)."""
    token = _ATTACH_NOW.set(lambda shards: attach_quantized(model, shards, kernel_dtype, native, halves))
    try:
        yield
    finally:
        _ATTACH_NOW.reset(token)


def attach_when_complete(quantized: QuantizedShards, target: str) -> None:
    """Attach ``target``'s shards now (taken out of ``quantized``) where ``attaching_as_loaded`` is on; a
    model's ``load_weights`` calls it once every shard of ``target`` has arrived."""
    attach = _ATTACH_NOW.get()
    if attach is not None and target in quantized:
        attach({target: quantized.pop(target)})


def _whole(shards: dict[str | None, AffineWeight | HalfWeight], names: list) -> AffineWeight | HalfWeight | None:
    """The layer's whole weight from its shards, or None where some shards are dense or of another kind."""
    if set(shards) != set(names):
        return None
    parts = [shards[n] for n in names]
    kind = type(parts[0])
    if any(type(part) is not kind for part in parts):
        return None
    return parts[0] if len(parts) == 1 else kind.concat(parts)


def _attach_half(module: nn.Module, weight: HalfWeight, dtype: torch.dtype, halves: CpuKernels | None,
                 tied_head: LMHead | None) -> None:
    """A 16-bit weight kept as it is where it multiplies (a linear layer, or an LM head tied to this
    embedding table, whose rows the table then reads from the head's blocks); dense otherwise."""
    if halves is not None and hasattr(module, "matmul"):
        pack_linear(module, weight.values, halves, [], dtype)
    elif halves is not None and isinstance(module, VocabEmbedding) and tied_head is not None:
        pack_linear(tied_head, weight.values, halves, [module], dtype)
    else:
        _load_dense(module, "weight", {None: weight})


def _attach(module: nn.Module, weight: AffineWeight, dtype: torch.dtype, kernel_dtype: torch.dtype,
            native: CpuKernels | None) -> None:
    if isinstance(module, VocabEmbedding):
        _replace_weight(module, AffineRows(weight, dtype))
        module.lookup = affine_embedding
    elif hasattr(module, "matmul") and (native is not None and native_fits(weight) or int4_packable(weight)):
        _pack(module, weight, kernel_dtype, native)
    else:
        log.info("%s: %d-bit %s weight has no packed kernel; dequantized", type(module).__name__, weight.bits,
                 weight.shape)
        _load_dense(module, "weight", {None: weight})


def _pack(module: nn.Module, weight: AffineWeight, kernel_dtype: torch.dtype, native: CpuKernels | None) -> None:
    """Replace a linear layer's dense weight by ``weight`` packed.

    With the ``native`` kernels every layer they take goes to them, the LM head included (at any number
    of rows: 8 rows of SmolLM2's 49152x576 head take 4.8 ms there, a bf16 dense copy 7.3 ms, torch's
    kernel on two 4-bit planes 11.6 ms), and nothing keeps a dense copy. Otherwise torch's int4 kernel
    takes them, and an LM head multiplied in half precision keeps a dense copy for steps of many rows,
    where that kernel is 4x slower."""
    if native is not None and native_fits(weight):
        packed = NativeWeight.from_affine(weight, native)
    else:
        packed = Int4Weight.from_affine(weight, kernel_dtype)
        if isinstance(module, LMHead) and kernel_dtype in (torch.bfloat16, torch.float16):
            packed.keep_dense_copy(weight, kernel_dtype, DENSE_MIN_ROWS)
    _replace_weight(module, packed)
    module.matmul = packed_linear
    if isinstance(packed, NativeWeight) and packed.fuses_silu and hasattr(module, "gated_matmul"):  # a [gate | up]
        module.gated_matmul = packed.gated_linear


def _load_dense(module: nn.Module, param_name: str, shards: dict[str | None, AffineWeight | HalfWeight]) -> None:
    with torch.no_grad():
        for shard, weight in shards.items():
            tensor = torch.from_numpy(weight.dequantize())
            if shard is None:
                getattr(module, param_name).data.copy_(tensor)
            else:
                module.load_shard(param_name, tensor, shard)


def _replace_weight(module: nn.Module, packed: nn.Module) -> None:
    del module.weight  # the dense parameter (shared with a tied embedding: only this module's name goes)
    module.weight = packed


def quantize_model(model: nn.Module, mode: str, kernel_dtype: torch.dtype, native: CpuKernels | None) -> int:
    """Quantize every dense linear layer and the LM head of a loaded float model; returns the count.

    Codes per group of 32 inputs, as GGUF's blocks: ``int8`` 8-bit (per group symmetric as Q8_0, or
    min/max where that is closer: ``affine.quantize_int8``), ``int4`` min/max 4-bit (Q4_1's) with the LM
    head in 8 bits, as llama.cpp's 4-bit files keep their output layer. Embedding tables stay as they
    are; a layer whose shape no kernel takes stays dense.
    """
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    count = 0
    for module in list(model.modules()):  # replacing weights adds modules
        weight = getattr(module, "weight", None)
        if not hasattr(module, "matmul") or not isinstance(weight, torch.Tensor):
            continue
        n, k = weight.shape
        if not (int4_fits(n, k) or native is not None and k % GROUP_SIZE == 0):
            continue
        dense = weight.detach().float().numpy()
        _pack(module, quantize_int4(dense) if mode == "int4" and not isinstance(module, LMHead)
              else quantize_int8(dense), kernel_dtype, native)
        count += 1
    return count
