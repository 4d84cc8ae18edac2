"""BERT-family encoders (BertModel: all-MiniLM, BGE, E5 ...; RobertaModel and XLMRobertaModel: multilingual-E5,
BGE-M3, the RoBERTa sentence-transformers), and their cross-encoders (``*ForSequenceClassification``: the
ms-marco MiniLM and BGE rerankers): bidirectional attention, no KV cache.

The model only encodes: `forward(input_ids, attention_mask)` returns the last layer's hidden states of a
padded batch, every token attending to every non-padding token (a cross-encoder: its label logits). Module names mirror transformers' own, so
a checkpoint's tensors load by name (a ``bert.`` prefix, the pooler and the MLM head are dropped). It runs
on the pooling path (core_pytorch_backend.pooling_runner), never through the generation scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.pooling import PoolingConfig

SKIPPED_PREFIXES = ("pooler.", "cls.", "lm_head.")  # the pooler and the MLM heads: sentence embeddings use neither
SKIPPED_SUFFIXES = ("position_ids",)  # a buffer some checkpoints save
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class _Embeddings(nn.Module):
    def __init__(self, config: Any, position_offset: int = 0) -> None:
        super().__init__()
        self.position_offset = position_offset  # RoBERTa numbers a text's positions from padding_idx + 1
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + self.position_offset
        if types is None:  # one segment: embeddings never pair two texts in one input
            types = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (p(x).view(batch, length, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(hidden // self.heads))
        return out.transpose(1, 2).reshape(batch, length, hidden)


class _Output(nn.Module):
    """dense -> residual add -> LayerNorm (the attention's and the feed-forward's output)."""

    def __init__(self, inputs: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _Output(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The BERT encoder: embeddings, then bidirectional transformer layers (post-LayerNorm)."""

    is_encoder = True  # no KV cache, no generation: the backend serves it on the pooling path
    #: the checkpoints' name prefix, dropped at load, and the parts of them it does not use
    prefix, skipped = "bert.", SKIPPED_PREFIXES

    def __init__(self, config: Any, ops: Any = None) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported")
        self.config = config
        self.embeddings = _Embeddings(config, self.position_offset(config))
        self.encoder = _Encoder(config)
        #: the longest input: the learned positions past the offset
        self.max_positions = config.max_position_embeddings - self.position_offset(config)

    @staticmethod
    def position_offset(config: Any) -> int:
        """Where a text's positions start in the learned table (0; RoBERTa's differ)."""
        return 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, length, hidden] of a right-padded batch (`attention_mask` 1 on real tokens)."""
        return self.encode(input_ids, attention_mask)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, types: torch.Tensor | None = None
               ) -> torch.Tensor:
        x = self.embeddings(input_ids, types)
        mask = attention_mask[:, None, None, :].bool()  # every query sees every real key, none of the padding
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers-named tensors; raises on unknown names and on parameters left unloaded."""
        params = dict(self.named_parameters())
        pending = set(params)
        for name, tensor in weights:
            name = name.removeprefix(self.prefix)
            if name.startswith(self.skipped) or name.endswith(SKIPPED_SUFFIXES):
                continue
            if name not in params:
                raise ValueError(f"unexpected tensor {name!r} in a {type(self).__name__} checkpoint")
            params[name].data.copy_(tensor)
            pending.discard(name)
        if pending:
            raise ValueError(f"the checkpoint lacks {len(pending)} tensors, e.g. {sorted(pending)[:3]}")


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's encoder whose positions start after the padding token's
    (``padding_idx + 1``, as transformers numbers a right-padded text's tokens), one token type, and
    checkpoints prefixed ``roberta.`` (the MLM ``lm_head`` dropped)."""

    prefix = "roberta."

    @staticmethod
    def position_offset(config: Any) -> int:
        return int(config.pad_token_id) + 1


CLASSIFY = PoolingConfig(method="classify", normalize=False)


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder (the ms-marco MiniLM rerankers): a pair of texts as one input, ``[CLS] a [SEP] b
    [SEP]``, the second text and its [SEP] of token type 1 (``set_separator``: the tokenizer's [SEP]), and the
    [CLS] state through BERT's pooler (dense, tanh) and the classifier: the input's label logits."""

    pooling = CLASSIFY
    skipped = ("cls.",)

    def __init__(self, config: Any, ops: Any = None) -> None:
        super().__init__(config, ops)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.separator: int | None = None

    def set_separator(self, token_id: int | None) -> None:
        """The tokenizer's separator, after whose first occurrence an input's tokens are of type 1."""
        self.separator = token_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        types = None
        if self.separator is not None and self.config.type_vocab_size > 1:
            seps = input_ids == self.separator
            types = ((seps.cumsum(1) - seps.long()) > 0).long()  # past the first [SEP]
        hidden = self.encode(input_ids, attention_mask, types)
        return self.classifier(torch.tanh(self.pooler.dense(hidden[:, 0])))


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa / XLM-RoBERTa cross-encoder (the BGE rerankers): a pair as one input, ``<s> a </s></s> b
    </s>``, one token type, and the first token's state through the classification head (dense, tanh,
    ``out_proj``): the input's label logits."""

    pooling = CLASSIFY
    skipped = ("lm_head.",)

    def __init__(self, config: Any, ops: Any = None) -> None:
        super().__init__(config, ops)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        first = self.encode(input_ids, attention_mask)[:, 0]
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))
