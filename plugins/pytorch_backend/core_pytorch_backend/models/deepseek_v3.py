"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3, V3.1, R1, Kimi K2, Moonlight): DeepSeek-V2's decoder
(models/deepseek_v2.py: multi-head latent attention, the expanded heads in the KV cache) with ``noaux_tc``
routing (models/grouped_router.py), rotary on pairs of adjacent values only where ``rope_interleave`` (the
default; rotate-half otherwise), and the checkpoints' multi-token-prediction layer (``model.layers.61``) skipped.

The released checkpoints are FP8: ``quantization_config`` {``quant_method``: fp8, ``weight_block_size``:
[128, 128]}, each linear weight float8_e4m3fn beside a float32 ``weight_scale_inv`` of one scale per block of
rows x inputs. Those weights are dequantized as they load (the weight times its block's scale, in float32, as
DeepSeek's ``weight_dequant``) into the model's dtype; activations are not quantized (DeepSeek's FP8 inference
quantizes them per group of 128, so its numbers differ slightly). Other quantization configs are refused."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..quant.attach import QuantizedShards
from .deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from .grouped_router import GroupedRouting, noaux_tc_routing
from .llama import LlamaModel

SCALE_SUFFIX = ".weight_scale_inv"


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    def routing_rule(self, config: Any) -> GroupedRouting:
        return noaux_tc_routing(config)


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_class = DeepseekV3Model

    @classmethod
    def check_routing(cls, config: Any) -> None:
        method = getattr(config, "topk_method", None)
        if method not in (None, "noaux_tc"):
            raise NotImplementedError(f"DeepseekV3: topk_method {method!r} is not supported (transformers' "
                                      "DeepSeek-V3 routes by noaux_tc alone)")

    @classmethod
    def check_quantization(cls, config: Any) -> None:
        if fp8_block_size(config) is None:
            super().check_quantization(config)

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        return bool(config.rope_interleave)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        block = fp8_block_size(self.config)
        return super().load_weights(weights if block is None else fp8_blocks_dequantized(weights, block))


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
