"""A sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite MoE): a router scores the experts,
each token runs through its ``top_k`` best (softmax probabilities, renormalized over those when ``normalize``;
Granite's: the softmax of the best ``top_k`` logits alone), and their outputs are summed with those weights,
expert by expert in index order, as transformers does. Each expert is a SwiGLU
``LlamaMLP`` (gate_up_proj, down_proj), so it is quantized and multiplied like any projection; the router
stays float."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..native import tile_rows
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaMLP, LlamaModel


class SparseMoeBlock(nn.Module):
    """``experts`` SwiGLU MLPs of ``expert_size``; the router's weight is ``gate.weight`` [experts, hidden].
    ``shared_size``: also a shared expert every token runs through (Qwen2-MoE's ``shared_expert``), its
    output scaled by ``sigmoid(shared_expert_gate(x))`` (``shared_gate``; Granite MoE Shared's is ungated) and
    added to the routed experts'. ``softmax_of_top_k``: the weights are the softmax of the chosen experts'
    logits (Granite MoE), not of all of them."""

    def __init__(self, config: Any, ops: Any, experts: int, top_k: int, expert_size: int, normalize: bool,
                 shared_size: int | None = None, shared_gate: bool = True, softmax_of_top_k: bool = False,
                 router_bias: bool = False, shared_bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, experts, bias=router_bias)  # the router
        self.experts = nn.ModuleList(self.make_expert(config, ops, expert_size) for _ in range(experts))
        self.top_k, self.normalize, self.softmax_of_top_k = top_k, normalize, softmax_of_top_k
        self.shared_expert = LlamaMLP(config, ops, shared_size, bias=shared_bias) if shared_size else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared_size and shared_gate else None
        self._native: tuple[tuple[int, int], Any] | None = None  # (_weight_ids(), ExpertMix or None)

    def make_expert(self, config: Any, ops: Any, size: int) -> nn.Module:
        """One routed expert: a SwiGLU ``LlamaMLP`` (gpt-oss's have biases and a clamped SwiGLU)."""
        return LlamaMLP(config, ops, size)

    def native_kernel(self, device: torch.device) -> Any:
        """The block as one native call (native/expert_mix.py's ExpertMix: ``block`` the whole block, ``mix`` the
        experts alone) where the experts are packed CPU weights, else None. Described on the first call, and again
        whenever an expert's weight was replaced."""
        described = self._native
        if described is None or described[0] != self._weight_ids():
            from ..native.expert_mix import ExpertMix

            described = self._native = (self._weight_ids(),
                                        ExpertMix.of_block(self) if device.type == "cpu" else None)
        return described[1]

    def _weight_ids(self) -> tuple[int, int]:
        """The first expert's weight and where its values are: a wakeup that reloads the model builds new modules,
        a move to another device new tensors."""
        weight = self.experts[0].gate_up_proj.weight
        values = weight._buffers.get("codes") if isinstance(weight, nn.Module) else weight
        return id(weight), 0 if values is None else values.data_ptr()

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's expert weights [T, top_k] in ``hidden``'s dtype, the experts they weigh [T, top_k])."""
        logits = nn.functional.linear(hidden, self.gate.weight, self.gate.bias).float()
        if self.softmax_of_top_k:
            best, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(best, dim=-1).to(hidden.dtype), chosen
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), chosen

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kernel = self.native_kernel(hidden.device)
        out = None if kernel is None else kernel.block(hidden)  # routed, mixed and the shared expert added in C
        if out is not None:
            return out
        weights, chosen = self.routing(hidden)
        out = None if kernel is None else kernel.mix(hidden, weights, chosen)
        if out is None:
            out = mix_experts(self.experts, hidden, weights, chosen)
        if self.shared_expert_gate is not None:
            gate = torch.sigmoid(nn.functional.linear(hidden, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(hidden)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(hidden)
        return out


def mix_experts(experts: Sequence[nn.Module], hidden: torch.Tensor, weights: torch.Tensor,
                chosen: torch.Tensor) -> torch.Tensor:
    """Each token's chosen experts' outputs ([T, top_k] ``chosen`` with their ``weights``) summed, expert by
    expert in ascending index order over the tokens that chose it, as transformers sums them."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(chosen).tolist():
        tokens, slot = torch.where(chosen == expert)
        with tile_rows.gathered(tokens, hidden.shape[0]):  # each token's row on its own loop, as in the step
            part = experts[expert](hidden[tokens]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, part.to(out.dtype))
    return out


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` of a Qwen MoE config has experts: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers`` (the others a dense MLP of ``intermediate_size``)."""
    return (index not in (getattr(config, "mlp_only_layers", None) or ()) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


def without_empty_shared_expert(weights: Iterable[tuple[str, Any]], config: Any) -> Iterable[tuple[str, Any]]:
    """The Qwen MoE families' checkpoint tensors, a shared expert of size 0 skipped: transformers builds an empty
    one (its 0-wide tensors and gate saved), which adds nothing; ``SparseMoeBlock`` builds none."""
    if getattr(config, "shared_expert_intermediate_size", None):
        return weights
    return ((name, tensor) for name, tensor in weights if ".mlp.shared_expert" not in name)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """Qwen2-MoE's and Qwen3-MoE's layer: experts of ``moe_intermediate_size`` where ``is_sparse_layer``
    (with Qwen2-MoE's shared expert where the config sizes one)."""

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().make_mlp(config, ops, spec, layer_index)
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)),
                              shared_size=getattr(config, "shared_expert_intermediate_size", None))


class QwenMoeModel(LlamaModel):
    layer_class = QwenMoeDecoderLayer


STACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def experts_one_by_one(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Stacked expert tensors (``experts.gate_up_proj`` [experts, 2 x size, hidden], ``experts.down_proj``
    [experts, hidden, size]: Gemma 4's, Qwen3.5-MoE's and transformers' fused layout) as one tensor per expert
    (``experts.{e}.gate_up_proj.weight``, whose gate rows come first as in ``LlamaMLP``, and
    ``experts.{e}.down_proj.weight``); other tensors as they are."""
    for name, tensor in weights:
        if not name.endswith(STACKED_EXPERTS):
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: stacked experts from a quantized file")
        prefix, projection = name.rsplit(".", 1)
        for expert in range(tensor.shape[0]):
            yield f"{prefix}.{expert}.{projection}.weight", tensor[expert]
