"""DistilBERT encoders (DistilBertModel: msmarco-distilbert, distiluse-base-multilingual's transformer ...).

BERT's post-LayerNorm layers (models/bert.py's, reused as they are) under other names and config keys: no
token type embeddings, learned positions from 0, every LayerNorm's epsilon fixed at 1e-12, the feed-forward's
``activation`` (gelu or relu). Checkpoints name the layers ``transformer.layer.N`` with
``attention.{q,k,v,out}_lin``, ``sa_layer_norm``, ``ffn.lin1`` / ``ffn.lin2`` and ``output_layer_norm``: they
load into BERT's modules. A ``distilbert.`` prefix (DistilBertForMaskedLM) and the MLM head (``vocab_*``) are
dropped. ``sinusoidal_pos_embds`` only initialises the position table, which checkpoints store: it changes
nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from core_pytorch_backend.models.bert import ACTIVATIONS, BertModel, _Encoder
from core_pytorch_backend.models.mpnet import _Embeddings, renamed

EPS = 1e-12  # transformers' DistilBERT hard-codes its LayerNorms' epsilon


class DistilBertModel(BertModel):
    """The DistilBERT encoder: BERT's layers, no token types, DistilBERT's names."""

    prefix, skipped = "distilbert.", ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.")
    RENAMES = (("transformer.layer.", "encoder.layer."),
               (".attention.q_lin.", ".attention.self.query."), (".attention.k_lin.", ".attention.self.key."),
               (".attention.v_lin.", ".attention.self.value."), (".attention.out_lin.", ".attention.output.dense."),
               (".sa_layer_norm.", ".attention.output.LayerNorm."), (".ffn.lin1.", ".intermediate.dense."),
               (".ffn.lin2.", ".output.dense."), (".output_layer_norm.", ".output.LayerNorm."))

    def __init__(self, config: Any, ops: Any = None) -> None:
        nn.Module.__init__(self)
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"activation {config.activation!r} is not supported")
        self.config = config
        bert = SimpleNamespace(hidden_size=config.dim, num_attention_heads=config.n_heads,
                               num_hidden_layers=config.n_layers, intermediate_size=config.hidden_dim,
                               hidden_act=config.activation, layer_norm_eps=EPS)  # BERT's keys for its modules
        self.embeddings = _Embeddings(config.vocab_size, config.max_position_embeddings, config.dim, EPS)
        self.encoder = _Encoder(bert)
        self.max_positions = config.max_position_embeddings

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, self.RENAMES))
