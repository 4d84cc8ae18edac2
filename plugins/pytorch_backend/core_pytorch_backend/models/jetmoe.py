"""JetMoE (``JetMoeForCausalLM``: jetmoe-8b): Llama's pre-norm layers whose attention and MLP are both mixtures of
``num_local_experts`` experts, each token through the ``num_experts_per_tok`` (k) best of its router's logits,
weighted by those logits' softmax, the experts' outputs summed in expert order plus a bias, as transformers'
``modeling_jetmoe``:

- the MLP: gated experts of ``intermediate_size`` and ``activation_function`` (models/sparse_moe.py's block, Granite
  MoE's routing) plus ``bias``;
- the attention (a mixture of attention heads): one k/v projection of ``num_key_value_heads`` heads of
  ``kv_channels`` every token shares; each chosen expert projects the token's queries for all those heads, so a
  token has k x ``num_key_value_heads`` query heads, the one of expert slot j and k/v head h attending over k/v head
  h; rotary (rotate-half) turns them all; each slot's attention output goes back through its expert's output
  projection, weighted and summed, plus ``bias``. Served as grouped-query attention, the query heads laid out
  k/v head by k/v head.

The layers' norms take eps 1e-6 whatever ``rms_norm_eps`` says (the final norm takes it), as transformers builds
them. The checkpoints' experts are stacked ([experts, out, in]): read one expert at a time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, Linear, RMSNorm, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

LAYER_NORM_EPS = 1e-6  # JetMoeRMSNorm's default, which transformers' layers keep
RENAMED = ((".self_attention.", ".self_attn."), (".router.layer.", ".router."))


class JetMoeMoeBlock(SparseMoeBlock):
    """The softmax of the best ``top_k`` logits over SwiGLU experts, plus an output ``bias``."""

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                         normalize=False, softmax_of_top_k=True)
        self.bias = nn.Parameter(torch.zeros(config.hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) + self.bias


class HeadExperts(nn.Module):
    """The attention's experts: each a query projection (``input_linear``) and an output projection
    (``output_linear``) of ``width`` = the k/v heads' width, routed as the MLP's, with an output ``bias``."""

    def __init__(self, config: Any, width: int) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(hidden, experts, bias=False)
        self.input_linear = nn.ModuleList(Linear(hidden, width) for _ in range(experts))
        self.output_linear = nn.ModuleList(Linear(width, hidden) for _ in range(experts))
        self.bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in ``hidden``'s dtype, experts [T, k]): the softmax of the best k logits."""
        best, chosen = torch.topk(nn.functional.linear(hidden, self.router.weight).float(), self.top_k, dim=-1)
        return torch.softmax(best, dim=-1).to(hidden.dtype), chosen

    def queries(self, hidden: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each token's queries from each of its chosen experts: [T, k, width]."""
        out = hidden.new_zeros(*chosen.shape, self.input_linear[0].weight.shape[0])
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            out[tokens, slot] = self.input_linear[expert](hidden[tokens])
        return out

    def outputs(self, attended: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``attended`` [T, k, width] through each slot's expert, weighted, summed in expert order, plus ``bias``."""
        out = attended.new_zeros(attended.shape[0], self.bias.shape[0])
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            out.index_add_(0, tokens, self.output_linear[expert](attended[tokens, slot]) * weights[tokens, slot, None])
        return out + self.bias


class JetMoeAttention(nn.Module):
    """The mixture of attention heads (module docstring)."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.kv_channels
        self.top_k = config.num_experts_per_tok
        width = self.kv_heads * self.head_dim
        self.experts = HeadExperts(config, width)
        self.kv_proj = Linear(config.hidden_size, 2 * width)
        self.rotary_emb = rotary
        self.attn = Attention(self.top_k * self.kv_heads, self.kv_heads, self.head_dim, self.head_dim**-0.5, ops,
                              None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        weights, chosen = self.experts.routing(hidden)
        by_kv_head = (t, self.kv_heads, self.top_k, self.head_dim)  # query head (h, j) attends over k/v head h
        q = self.experts.queries(hidden, chosen).view(t, self.top_k, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(hidden).chunk(2, dim=-1)
        q, k = self.rotary_emb(positions, q.reshape(t, -1), k.contiguous())
        attended = self.attn(q, k, v.contiguous(), meta).view(by_kv_head).transpose(1, 2)
        return self.experts.outputs(attended.reshape(t, self.top_k, -1), weights, chosen)


class JetMoeDecoderLayer(LlamaDecoderLayer):
    attention_class = JetMoeAttention

    def __init__(self, config: Any, ops: Any, *args: Any) -> None:
        super().__init__(config, ops, *args)
        self.input_layernorm = RMSNorm(config.hidden_size, LAYER_NORM_EPS, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, LAYER_NORM_EPS, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return JetMoeMoeBlock(config, ops)


class JetMoeModel(LlamaModel):
    layer_class = JetMoeDecoderLayer


class JetMoeForCausalLM(LlamaForCausalLM):
    model_class = JetMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any) -> None:
        config.hidden_act = config.activation_function  # JetMoE's name for the experts' activation
        super().__init__(config, ops)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The stacked experts one by one: the attention's ``input_linear`` / ``output_linear`` as ``{e}.weight``, the
    MLP's as its experts' ``gate_up_proj`` / ``down_proj``; the routers as ``router`` / ``gate``."""
    for name, tensor in weights:
        name = parts_renamed(name, RENAMED).replace(".mlp.router.", ".mlp.gate.")
        prefix, _, projection = name.rpartition(".")[0].rpartition(".")
        if projection not in ("input_linear", "output_linear"):
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: stacked experts from a quantized file")
        for expert, weight in enumerate(tensor.unbind(0)):
            if prefix.endswith(".mlp"):
                part = "gate_up_proj" if projection == "input_linear" else "down_proj"
                yield f"{prefix}.experts.{expert}.{part}.weight", weight
            else:
                yield f"{prefix}.{projection}.{expert}.weight", weight
