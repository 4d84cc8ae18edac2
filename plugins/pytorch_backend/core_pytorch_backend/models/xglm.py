"""XGLM (Meta's multilingual XGLM 564M to 7.5B): OPT's decoder (models/opt.py: pre-norm layers with LayerNorms,
biased projections, q scaled after its projection, an ungated MLP of ``fc1`` / ``fc2``, here GELU) with
embeddings times ``sqrt(d_model)`` (``scale_embedding``) and fixed sinusoidal positions, offset by 2 like OPT's
(fairseq's table: sines then cosines, the pad token's row zero), and the LM head tied to the embeddings.
Following transformers' ``modeling_xglm``; its final ``model.layer_norm`` is read as ``model.norm``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .opt import POSITION_OFFSET, OPTForCausalLM, ScaledEmbeddingOPTModel

RENAMED = (("model.layer_norm.", "model.norm."),)


def sinusoidal_table(rows: int, width: int, padding_row: int | None) -> torch.Tensor:
    """fairseq's sinusoidal positions as transformers' ``XGLMSinusoidalPositionalEmbedding.get_embedding``."""
    half = width // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(rows, -1)
    if width % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    if padding_row is not None and padding_row < rows:
        table[padding_row] = 0
    return table


class SinusoidalPositions(nn.Module):
    """A fixed table of position embeddings (a buffer, not in the checkpoint), looked up by row."""

    def __init__(self, rows: int, width: int, padding_row: int | None):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(rows, width, padding_row), persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.table[rows]


class XGLMModel(ScaledEmbeddingOPTModel):
    def make_positions(self, config: Any) -> nn.Module:
        return SinusoidalPositions(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size,
                                   config.pad_token_id)


class XGLMForCausalLM(OPTForCausalLM):
    model_class = XGLMModel
    checkpoint_renames = RENAMED
