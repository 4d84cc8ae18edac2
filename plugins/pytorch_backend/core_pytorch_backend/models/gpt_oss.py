"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b; transformers' ``GptOssForCausalLM``): Llama's pre-norm
layers with q/k/v/o biases, grouped-query attention whose softmax takes one more learned logit per head
(``self_attn.sinks``: the ``Attention`` layer's ``sinks``), layers alternating a window of ``sliding_window``
(128) and full attention by ``layer_types``, YaRN rotary (factor 32 over an original 4,096 positions, not
truncated: ``layers/rotary.py``), and on every layer a mixture of ``num_local_experts`` experts
(models/sparse_moe.py). Its router has a bias and weighs each token's ``num_experts_per_tok`` best experts by
the softmax of their logits alone; each expert is a ``LlamaMLP`` with biases (quantized and multiplied like any
projection) whose activation is gpt-oss's clamped SwiGLU: the gate clamped above at ``swiglu_limit`` (7), up
clamped to +-limit, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (alpha 1.702).

Checkpoints hold each layer's experts fused, as transformers' ``GptOssExperts`` keeps them: ``mlp.experts.
gate_up_proj`` [experts, hidden, 2 * intermediate] ([in, out], gate and up interleaved column by column:
gate = [..., ::2], up = [..., 1::2]), ``gate_up_proj_bias``, ``down_proj`` [experts, intermediate, hidden]
and ``down_proj_bias``; the router is ``mlp.router``. OpenAI's checkpoints (``quantization_config``
``{"quant_method": "mxfp4"}``) store the two projections in MXFP4 instead: ``*_blocks`` [experts, out,
in / 32, 16] uint8, two FP4 (e2m1) codes a byte (the low nibble first), and ``*_scales`` [experts, out,
in / 32] uint8, one power of two 2^(scale - 127) per 32 inputs; they are dequantized at load, expert by
expert (quant/mxfp4.py), as transformers' ``Mxfp4Config(dequantize=True)`` does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..layers import RMSNorm
from ..quant.attach import QuantizedShards
from ..quant.mxfp4 import dequantize_mxfp4
from .llama import (
    DecoderSpec,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_types_of,
    layer_types_windows,
)
from .sparse_moe import SparseMoeBlock

LAYER_TYPES = ("sliding_attention", "full_attention")
MXFP4_PARTS = ("_blocks", "_scales")  # the two tensors of one MXFP4 weight, named after it


def check_supported(config: Any) -> None:
    """NotImplementedError naming the config field this implementation does not serve."""
    method = (getattr(config, "quantization_config", None) or {}).get("quant_method")  # AutoConfig's dict
    if method not in (None, "mxfp4"):
        raise NotImplementedError(f"gpt-oss: quantization_config.quant_method {str(method)!r} is not supported "
                                  "(mxfp4, dequantized at load, or a float checkpoint)")
    unknown = sorted(set(layer_types_of(config)) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"gpt-oss: layer_types {unknown} are not supported (supported: {LAYER_TYPES})")


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated activation of a [gate | up] projection: ``(up + 1) * gate * sigmoid(alpha * gate)``,
    the gate clamped above at ``limit`` and up to [-limit, limit] first."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExpert(LlamaMLP):
    """One expert: gate_up_proj and down_proj with biases, the clamped SwiGLU between them."""

    def __init__(self, config: Any, ops: Any, size: int):
        super().__init__(config, ops, size, bias=True)
        self.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)


class GptOssMoe(SparseMoeBlock):
    """``num_local_experts`` experts behind a router with a bias (``gate``: the checkpoint's ``mlp.router``),
    each token through its ``num_experts_per_tok`` best, weighed by the softmax of their logits alone."""

    def __init__(self, config: Any, ops: Any):
        super().__init__(config, ops, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                         normalize=False, softmax_of_top_k=True, router_bias=True)

    def make_expert(self, config: Any, ops: Any, size: int) -> nn.Module:
        return GptOssExpert(config, ops, size)


class GptOssRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32 before the one rounding to x's dtype (transformers keeps
    gpt-oss's norms in float32); with ``residual``, ``(norm(x + residual), x + residual)``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = self.ops.rms_norm(x.float(), self.weight.float(), self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its attention with the spec's sinks) with gpt-oss's norms and experts."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: Any):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return GptOssMoe(config, ops)


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    #: the sinks are per head and the experts are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        check_supported(config)
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(config.attention_bias)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=layer_types_windows(config), o_bias=bias,
                           attn_sinks=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(llama_names(weights))


def llama_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """gpt-oss's checkpoint tensors under the names of this model's modules: the sinks as the attention
    layer's, the router as ``mlp.gate``, and each fused (or MXFP4: dequantized) expert tensor as per-expert
    Qwen-MoE names (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, [out, in])."""
    halves: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 tensor's blocks or scales, until the other comes
    for name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
        elif ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        elif name.endswith(MXFP4_PARTS):
            weight, part = name.rsplit("_", 1)
            halves.setdefault(weight, {})[part] = tensor
            if len(halves[weight]) == 2:
                parts = halves.pop(weight)
                yield from per_expert(weight, _Mxfp4(parts["blocks"], parts["scales"]))
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from per_expert(name, tensor.transpose(1, 2))  # [experts, in, out] -> [experts, out, in]
        elif name.endswith((".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj_bias")):
            yield from per_expert(name, tensor)
        else:
            yield name, tensor
    if halves:
        raise ValueError(f"checkpoint has only half of the MXFP4 tensors {sorted(halves)} (blocks and scales)")


class _Mxfp4:
    """An MXFP4 tensor's blocks and scales, read expert by expert (one dequantized expert at a time)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[expert], self.scales[expert])


def per_expert(name: str, fused: torch.Tensor | _Mxfp4) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert ``e``'s slices of a fused expert tensor ``{prefix}.mlp.experts.{proj}[_bias]`` ([experts, out,
    in] weights, [experts, out] biases), gate_up's interleaved rows split into gate (even) and up (odd)."""
    prefix, proj = name.rsplit(".", 1)
    kind = "bias" if proj.endswith("_bias") else "weight"
    for expert in range(len(fused)):
        rows = fused[expert]
        if proj.startswith("gate_up_proj"):
            yield f"{prefix}.{expert}.gate_proj.{kind}", rows[0::2]
            yield f"{prefix}.{expert}.up_proj.{kind}", rows[1::2]
        else:
            yield f"{prefix}.{expert}.down_proj.{kind}", rows
