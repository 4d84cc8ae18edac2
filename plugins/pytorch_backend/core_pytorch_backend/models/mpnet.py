"""MPNet encoders (MPNetModel: sentence-transformers' all-mpnet-base-v2, multi-qa-mpnet ...).

BERT's post-LayerNorm layers (models/bert.py's, reused as they are) with two differences: a T5-style relative
position bias (log-spaced buckets of the key's distance from the query, one learned value per bucket and head,
``encoder.relative_attention_bias``) computed once and added to every layer's attention scores, and no token
type embeddings; the learned absolute positions start at 2, as RoBERTa's (transformers fixes MPNet's padding
index at 1). Checkpoints name the attention ``attention.attn.{q,k,v,o}`` and ``attention.LayerNorm``: they load
into BERT's ``attention.self.{query,key,value}`` / ``attention.output``. An ``mpnet.`` prefix (MPNetForMaskedLM),
the pooler and the MLM head are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from core_pytorch_backend.models.bert import BertModel, _Encoder

BUCKETS = 32  # transformers buckets with 32 whatever relative_attention_num_buckets says (that only sizes the table)
MAX_DISTANCE = 128


class _Embeddings(nn.Module):
    """Words plus learned absolute positions (from ``position_offset``), then LayerNorm: no token types."""

    def __init__(self, vocab: int, positions: int, hidden: int, eps: float, position_offset: int = 0) -> None:
        super().__init__()
        self.position_offset = position_offset
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, input_ids: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + self.position_offset
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


def renamed(weights: Iterable[tuple[str, torch.Tensor]], renames: tuple[tuple[str, str], ...]
            ) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors under BERT's module names: each ``(old, new)`` substring replaced in turn."""
    for name, tensor in weights:
        for old, new in renames:
            name = name.replace(old, new)
        yield name, tensor


def relative_position_bucket(relative: torch.Tensor) -> torch.Tensor:
    """transformers' MPNet bucket of each key-minus-query distance: half the buckets per direction, 8 exact
    distances, then log-spaced up to 128 (MPNetEncoder.relative_position_bucket)."""
    half = BUCKETS // 2
    n = -relative
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(MAX_DISTANCE / exact) * (half - exact)).long()
    return ret + torch.where(n < exact, n, large.clamp(max=half - 1))


class MPNetModel(BertModel):
    """The MPNet encoder: BERT's layers, a shared relative position bias on the attention scores."""

    prefix, skipped = "mpnet.", ("pooler.", "lm_head.")
    RENAMES = ((".attention.attn.q.", ".attention.self.query."), (".attention.attn.k.", ".attention.self.key."),
               (".attention.attn.v.", ".attention.self.value."), (".attention.attn.o.", ".attention.output.dense."),
               (".attention.LayerNorm.", ".attention.output.LayerNorm."))

    def __init__(self, config: Any, ops: Any = None) -> None:
        nn.Module.__init__(self)
        if config.relative_attention_num_buckets < BUCKETS:  # transformers would index past the table
            raise ValueError(f"relative_attention_num_buckets {config.relative_attention_num_buckets} < {BUCKETS}")
        self.config = config
        offset = 2  # transformers numbers positions from its fixed padding index 1, plus one
        self.embeddings = _Embeddings(config.vocab_size, config.max_position_embeddings, config.hidden_size,
                                      config.layer_norm_eps, offset)
        self.encoder = _Encoder(config)
        self.encoder.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets,
                                                            config.num_attention_heads)
        self.max_positions = config.max_position_embeddings - offset

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, types: torch.Tensor | None = None
               ) -> torch.Tensor:
        x = self.embeddings(input_ids)
        length = input_ids.shape[1]
        place = torch.arange(length, device=input_ids.device)
        buckets = relative_position_bucket(place[None, :] - place[:, None])  # [query, key]
        bias = self.encoder.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # [1, heads, query, key]
        real = attention_mask[:, None, None, :].bool()  # every query sees every real key, none of the padding
        mask = bias.masked_fill(~real, torch.finfo(bias.dtype).min)  # scores + bias, padding keys off
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, self.RENAMES))
