"""CodeGen (Salesforce's CodeGen 1 / 2.5 mono and multi): GPT-J (models/gptj.py: one LayerNorm, attention and a
GELU MLP side by side, pair rotary on the first ``rotary_dim`` of each head, an LM head with a bias) whose q, v and
k come fused in one ``qkv_proj`` as its model-parallel training cut them: 4 groups, each of its share of q, then v,
then k rows. They are read as GPT-J's ``q_proj`` / ``k_proj`` / ``v_proj`` at load. Following transformers'
``modeling_codegen``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..quant.attach import QuantizedShards
from .gptj import GPTJForCausalLM

#: the groups of transformers' ``CodeGenAttention.mp_num``
MP_GROUPS = 4


class CodeGenForCausalLM(GPTJForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_qkv_split(weights))


def _qkv_split(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each ``attn.qkv_proj.weight`` as ``q_proj``, ``k_proj`` and ``v_proj``."""
    for name, tensor in weights:
        if not name.endswith(".attn.qkv_proj.weight"):
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: CodeGen's fused q/v/k from a quantized file")
        hidden = tensor.shape[1]
        q, v, k = tensor.reshape(MP_GROUPS, 3, -1, hidden).unbind(1)
        prefix = name.removesuffix("qkv_proj.weight")
        for part, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            yield f"{prefix}{part}.weight", rows.reshape(-1, hidden)
