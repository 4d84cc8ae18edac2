"""Nemotron-H (``NemotronHForCausalLM``: nvidia/Nemotron-H-8B / -47B / -56B, NVIDIA-Nemotron-Nano-9B-v2 / -12B-v2,
Nemotron-3-Nano-30B-A3B): every layer is one RMSNorm and one mixer added to the residual, the mixer's kind given
by ``hybrid_override_pattern`` (transformers: ``layers_block_type``): ``M`` the Mamba-2 mixer
(models/mamba2_mixer.py; in_proj / out_proj biases from ``use_bias``), ``*`` attention without any position
encoding (Llama's attention with no rotary, never biased: transformers ignores ``attention_bias`` here), ``-``
an ungated MLP ``down(relu(up(x)) ** 2)`` (``mlp_hidden_act``), ``E`` a mixture of such experts (DeepSeek-V3's
``noaux_tc`` routing, models/grouped_router.py) beside a shared one of ``moe_shared_expert_intermediate_size``,
the experts behind ``fc1_latent_proj`` / ``fc2_latent_proj`` where ``moe_latent_size`` is set. Checkpoints name
the stack ``backbone`` (``embeddings``, ``layers.{i}.norm`` / ``.mixer``, ``norm_f``); the multi-token
prediction layers (``mtp.*``) are skipped, as transformers skips them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RMSNorm
from ..quant.attach import QuantizedShards
from .grouped_router import GroupedMoeBlock, noaux_tc_routing
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaModel, input_norm
from .mamba2 import RENAMED
from .mamba2_mixer import Mamba2Mixer, MixerSpec, time_step_limit_of
from .names import prefix_renamed
from .sparse_moe import SparseMoeBlock, mix_experts
from .ungated_mlp import UngatedMLP

KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
         "mlp": "mlp", "moe": "moe"}


def mixer_spec(config: Any) -> MixerSpec:
    return MixerSpec(hidden_size=config.hidden_size, heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
                     state_size=config.ssm_state_size, groups=config.n_groups, conv_kernel=config.conv_kernel,
                     chunk_size=config.chunk_size, norm_eps=config.layer_norm_epsilon,
                     activation=config.mamba_hidden_act, conv_bias=bool(config.use_conv_bias),
                     in_bias=bool(config.use_bias), out_bias=bool(config.use_bias),
                     time_step_limit=time_step_limit_of(config.time_step_limit))


def relu2_mlp(config: Any, size: int, input_size: int | None = None) -> UngatedMLP:
    return UngatedMLP(input_size or config.hidden_size, size, config.mlp_hidden_act, ("up_proj", "down_proj"),
                      bias=bool(config.mlp_bias))


class NemotronHMoE(GroupedMoeBlock):
    """Ungated experts (no biases) routed by ``noaux_tc``, over the latent projection where there is one, and
    the ungated shared MLP (``shared_experts``) of the layer's input."""

    def __init__(self, config: Any, ops: Any):
        rule = noaux_tc_routing(config)
        SparseMoeBlock.__init__(self, config, ops, config.n_routed_experts, rule.top_k, config.moe_intermediate_size,
                                rule.normalize)  # GroupedMoeBlock's shared MLP is gated
        self.rule = rule
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)
        # transformers' MLP takes a size of 0 (or None) for intermediate_size's, never for no shared MLP
        shared = config.moe_shared_expert_intermediate_size or config.intermediate_size
        self.shared_experts = relu2_mlp(config, shared)
        latent = config.moe_latent_size
        self.fc1_latent_proj = Linear(config.hidden_size, latent, bias=bool(config.mlp_bias)) if latent else None
        self.fc2_latent_proj = Linear(latent, config.hidden_size, bias=bool(config.mlp_bias)) if latent else None

    def make_expert(self, config: Any, ops: Any, size: int) -> nn.Module:
        return UngatedMLP(config.moe_latent_size or config.hidden_size, size, config.mlp_hidden_act,
                          ("up_proj", "down_proj"), bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.routing(hidden)
        inputs = hidden if self.fc1_latent_proj is None else self.fc1_latent_proj(hidden)
        out = mix_experts(self.experts, inputs, weights, chosen)
        out = out if self.fc2_latent_proj is None else self.fc2_latent_proj(out)
        return out + self.shared_experts(hidden)


class NemotronHBlock(nn.Module):
    """One RMSNorm and one mixer of the layer's kind; the (hidden, residual) protocol of the Llama layers."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: None):
        super().__init__()
        kind = config.layers_block_type[layer_index]
        if kind not in KINDS:
            raise NotImplementedError(f"Nemotron-H: layers_block_type[{layer_index}] {kind!r} is not supported "
                                      f"(supported: {', '.join(KINDS)})")
        self.kind = KINDS[kind]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)
        self.mixer = self.make_mixer(config, ops, spec, layer_index)

    def make_mixer(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if self.kind == "mamba":
            return Mamba2Mixer(mixer_spec(config))
        if self.kind == "attention":
            return LlamaAttention(config, ops, spec, layer_index, None)
        if self.kind == "mlp":
            return relu2_mlp(config, config.intermediate_size)
        return NemotronHMoE(config, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.norm, hidden, residual)
        if self.kind == "mamba":
            return self.mixer(hidden, meta), residual
        if self.kind == "attention":
            return self.mixer(hidden, positions, meta), residual
        return self.mixer(hidden), residual


class NemotronHModel(LlamaModel):
    layer_class = NemotronHBlock

    def make_rotaries(self, config: Any, ops: Any) -> list[None]:
        return [None] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)


class NemotronHForCausalLM(LlamaForCausalLM):
    model_class = NemotronHModel
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        if config.tie_word_embeddings:
            raise NotImplementedError("Nemotron-H: tie_word_embeddings True is not supported (transformers never "
                                      "ties Nemotron-H's LM head to its embeddings)")
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint names as ours: ``backbone`` as ``model``, fused experts one by one, ``mtp.*`` left out."""
    for name, tensor in weights:
        if name.startswith("mtp."):
            continue
        name = prefix_renamed(name, RENAMED)
        if name.endswith((".mixer.experts.up_proj", ".mixer.experts.down_proj")):
            if not isinstance(tensor, torch.Tensor):
                raise NotImplementedError(f"{name}: fused experts from a quantized file")
            prefix, projection = name.rsplit(".", 1)
            for expert, weight in enumerate(tensor.unbind(0)):
                yield f"{prefix}.{expert}.{projection}.weight", weight
        else:
            yield name, tensor
