"""Block-scaled FP8 checkpoints (``quantization_config`` {``quant_method``: fp8, ``fmt``: e4m3,
``weight_block_size``: [rows, inputs]}: DeepSeek-V3 / R1, Kimi K2, Qwen3's -FP8 releases): each linear weight
float8_e4m3fn beside a float32 ``weight_scale_inv`` holding one scale per block of rows x inputs. The loader
reads them as the float32 weights they stand for (the codes times their block's scale, as DeepSeek's
``weight_dequant``), for any architecture; the model's dtype or ``--quantization`` then applies as to any
float checkpoint."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

SCALE_SUFFIX = ".weight_scale_inv"


def fp8_block_size(config: Any) -> tuple[int, int] | None:
    """(rows, inputs) of a block-scaled FP8 checkpoint's scales (``quantization_config``), else None."""
    quantization = getattr(config, "quantization_config", None)
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if quantization.get("fmt", "e4m3") != "e4m3" or not isinstance(block, (list, tuple)) or len(block) != 2:
        return None
    return int(block[0]), int(block[1])


def fp8_blocks_dequantized(weights: Iterable[tuple[str, Any]], block: tuple[int, int]
                           ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each float8_e4m3fn ``X.weight`` and its ``X.weight_scale_inv`` (in either
    order, in any file) given as one float32 ``X.weight``."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            key = name[: -len(SCALE_SUFFIX)] + ".weight"
        elif isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float8_e4m3fn:
            key = name
        else:
            yield name, tensor
            continue
        other = pending.pop(key, None)
        if other is None:
            pending[key] = tensor
            continue
        weight, scale = (other, tensor) if name.endswith(SCALE_SUFFIX) else (tensor, other)
        yield key, block_dequantized(weight, scale, block, key)
    if pending:
        raise ValueError(f"FP8 checkpoint: {len(pending)} weights or scales without their pair, e.g. {sorted(pending)[:3]}")


def block_dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """``weight`` [rows, inputs] times ``scale`` [ceil(rows / block rows), ceil(inputs / block inputs)], per block."""
    rows, inputs = weight.shape
    expected = (-(-rows // block[0]), -(-inputs // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: {tuple(scale.shape)} scales for a {rows} x {inputs} weight in blocks of {block}")
    scales = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :inputs]
    return weight.float() * scales
