"""Put quantized weights into a built model: packed where a kernel takes them, dense where none does.

Two ways in: ``attach_quantized`` for tensors that arrive quantized (a GGUF file's Q4_0 / Q4_1 / Q8_0 /
Q4_K tensors, as ``AffineWeight``), and ``quantize_model`` for a float checkpoint quantized at load
(``--quantization int8|int4``). Either way a layer's dense parameter is replaced by a packed module
(``layers.quantized``) and its ``matmul`` (or an embedding's ``lookup``) by the packed version; the
loader says which dtype the packed kernels multiply in.
"""

from __future__ import annotations

import logging

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
from ..native.library import available
from ..native.packed_weight import NativeWeight, native_fits
from .affine import AffineWeight, quantize_int4, quantize_int8

log = logging.getLogger(__name__)
MODES = ("int8", "int4")


# parameter name -> shard name (None for an unfused parameter) -> codes: what a model's load_weights
# returns for the tensors that arrived quantized
QuantizedShards = dict[str, dict[str | None, AffineWeight]]


def attach_quantized(model: nn.Module, quantized: QuantizedShards, kernel_dtype: torch.dtype) -> None:
    """Keep each layer's quantized tensors packed, multiplied in ``kernel_dtype``."""
    for target, shards in quantized.items():
        module_name, param_name = target.rsplit(".", 1)
        module = model.get_submodule(module_name)
        dtype = getattr(module, param_name).dtype
        names = getattr(module, "shard_names", [None])
        if param_name != "weight" or set(shards) != set(names):  # partly dense: the layer stays dense
            _load_dense(module, param_name, shards)
            continue
        weight = shards[None] if None in shards else AffineWeight.concat([shards[n] for n in names])
        _attach(module, weight, dtype, kernel_dtype)
        lm_head = getattr(model, "lm_head", None)
        if isinstance(module, VocabEmbedding) and isinstance(lm_head, LMHead) and lm_head.tied:
            _attach(lm_head, weight, dtype, kernel_dtype)  # the tied LM head multiplies by the same codes


def _attach(module: nn.Module, weight: AffineWeight, dtype: torch.dtype, kernel_dtype: torch.dtype) -> None:
    if isinstance(module, VocabEmbedding):
        _replace_weight(module, AffineRows(weight, dtype))
        module.lookup = affine_embedding
    elif hasattr(module, "matmul") and int4_packable(weight):
        _pack(module, weight, kernel_dtype)
    else:
        log.info("%s: %d-bit %s weight has no packed kernel; dequantized", type(module).__name__, weight.bits,
                 weight.shape)
        _load_dense(module, "weight", {None: weight})


def _pack(module: nn.Module, weight: AffineWeight, kernel_dtype: torch.dtype) -> None:
    """Replace a linear layer's dense weight by ``weight`` packed, multiplied by torch's int4 kernel.

    The LM head (a fifth of a small model's weights, and a decode step's largest matmul) is special
    twice. Its 8-bit codes go to the native kernel where it builds: at one row it takes half the time
    of torch's kernel on two 4-bit planes (430 vs 770 us for SmolLM2's 49152x576 head on the Zen 5
    EPYC), with activations rounded in two int8 steps (~1e-4 relative error, finer than bf16's). At
    8 rows it is no faster, so other 8-bit layers stay on torch's kernel, and so does a head multiplied
    in float32 (named to be exact). And the head keeps a dense half-precision copy for steps of many
    rows, where a packed kernel is 4x slower."""
    head = isinstance(module, LMHead)
    kernels = available() if head and weight.bits > 4 and kernel_dtype == torch.bfloat16 else None
    packed = (NativeWeight.from_affine(weight, kernels) if kernels is not None and native_fits(weight)
              else Int4Weight.from_affine(weight, kernel_dtype))
    if head and kernel_dtype in (torch.bfloat16, torch.float16):
        packed.keep_dense_copy(weight, kernel_dtype, DENSE_MIN_ROWS)
    _replace_weight(module, packed)
    module.matmul = packed_linear


def _load_dense(module: nn.Module, param_name: str, shards: dict[str | None, AffineWeight]) -> None:
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


def quantize_model(model: nn.Module, mode: str, kernel_dtype: torch.dtype) -> int:
    """Quantize every dense linear layer and the LM head of a loaded float model; returns the count.

    Codes per group of 32 inputs, as GGUF's blocks: ``int8`` symmetric 8-bit (Q8_0's layout), ``int4``
    min/max 4-bit (Q4_1's) with the LM head in 8 bits, as llama.cpp's 4-bit files keep their output
    layer. Embedding tables stay as they are; a layer whose shape the kernel does not take stays dense.
    """
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    count = 0
    for module in list(model.modules()):  # replacing weights adds modules
        weight = getattr(module, "weight", None)
        if not hasattr(module, "matmul") or not isinstance(weight, torch.Tensor) or not int4_fits(*weight.shape):
            continue
        dense = weight.detach().float().numpy()
        _pack(module, quantize_int4(dense) if mode == "int4" and not isinstance(module, LMHead)
              else quantize_int8(dense), kernel_dtype)
        count += 1
    return count
