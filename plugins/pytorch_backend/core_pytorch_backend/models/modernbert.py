"""ModernBERT encoders (model_type ``modernbert``: answerdotai/ModernBERT-base, Alibaba-NLP/gte-modernbert-base,
nomic-ai/modernbert-embed-base): bidirectional attention, no KV cache, served on the pooling path like BERT.

What differs from BERT, as transformers' ``ModernBertModel`` computes it (the parity oracle):

- embeddings: the token embeddings and a LayerNorm, no learned positions (``norm_bias``: whether the norms
  have a bias);
- pre-norm layers: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``, ``attn_norm`` being the
  identity in layer 0 (the embeddings' norm precedes it), and a ``final_norm`` after the last layer;
- attention: one fused ``Wqkv`` projection, rotary positions on q and k (``rotate_half`` style, default
  frequencies) with ``global_rope_theta`` on the global layers and ``local_rope_theta`` on the local ones;
  layers alternate (``layer_types``, or older configs' ``global_attn_every_n_layers``: layer i is global
  when i % n == 0) between global attention (every real token) and a bidirectional sliding window (real
  tokens at most ``local_attention // 2`` positions away on either side);
- a GeGLU MLP: ``Wi`` -> chunk into (input, gate) -> ``act(input) * gate`` -> ``Wo``.

transformers may unpad the batch internally (flash attention); on a right-padded batch the real tokens'
states are the same. Padding queries here attend to themselves too, so that no attention row is fully
masked (a NaN there would spread to the real tokens through the padding's values).

Checkpoints name the encoder's tensors as transformers does, prefixed ``model.`` in the MLM and classifier
checkpoints (ModernBERT-base's ``ModernBertForMaskedLM``), whose ``head``, ``decoder`` and ``classifier`` are
dropped: sentence embeddings use none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.rotary import default_inv_freq

PREFIX = "model."
SKIPPED_PREFIXES = ("head.", "decoder.", "classifier.")  # the MLM / classification heads
ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
GLOBAL, LOCAL = "full_attention", "sliding_attention"


def _layer_types(config: Any) -> list[str]:
    """Each layer's attention: transformers 5's ``layer_types``, or (older configs) every
    ``global_attn_every_n_layers``-th layer global, from layer 0, and the others local."""
    types = getattr(config, "layer_types", None)
    if types is None:
        every = int(getattr(config, "global_attn_every_n_layers", 3))
        types = [LOCAL if i % every else GLOBAL for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers:
        raise NotImplementedError(f"layer_types names {len(types)} layers for {config.num_hidden_layers}")
    unknown = sorted(set(types) - {GLOBAL, LOCAL})
    if unknown:
        raise NotImplementedError(f"ModernBERT layer_types {unknown} are not supported (only {GLOBAL}, {LOCAL})")
    return types


def _rope_theta(config: Any, kind: str) -> float:
    """The rotary base of ``kind``'s layers: transformers 5's ``rope_parameters[kind]["rope_theta"]``, or
    ``global_rope_theta`` / ``local_rope_theta`` (older configs; no local one: the global one, as transformers
    4 did). Only the default (unscaled) frequencies are supported."""
    params = getattr(config, "rope_parameters", None)
    theta = None
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        settings = params[kind]
        rope_type = settings.get("rope_type") or settings.get("type") or "default"
        if rope_type != "default":
            raise NotImplementedError(f"ModernBERT rope_type {rope_type!r} ({kind}) is not supported (only default)")
        theta = settings.get("rope_theta")
    elif getattr(config, "rope_scaling", None):
        raise NotImplementedError(f"ModernBERT rope_scaling {config.rope_scaling!r} is not supported")
    if theta is None and kind == LOCAL:
        theta = getattr(config, "local_rope_theta", None)
    if theta is None:
        theta = getattr(config, "global_rope_theta", None)
    if theta is None:
        raise NotImplementedError(f"no rope_theta for ModernBERT's {kind} layers in the config")
    return float(theta)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class _Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.Wqkv(x).view(batch, length, 3, self.heads, self.head_dim).unbind(dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # rotated in float32, as transformers does (cos / sin already rounded to the model's dtype)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.Wo(out.transpose(1, 2).reshape(batch, length, hidden))


class _MLP(nn.Module):
    """GeGLU: ``Wo(act(input) * gate)``, ``input, gate = Wi(x).chunk(2)`` (the first half activated)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inputs) * gate)


class _Layer(nn.Module):
    def __init__(self, config: Any, index: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.attn_norm = (nn.Identity() if index == 0
                          else nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias))
        self.attn = _Attention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """The ModernBERT encoder: embeddings, pre-norm layers of global or sliding-window attention with rotary
    positions and a GeGLU MLP, and a final norm (module docstring)."""

    is_encoder = True  # no KV cache, no generation: the backend serves it on the pooling path
    prefix, skipped = PREFIX, SKIPPED_PREFIXES

    def __init__(self, config: Any, ops: Any = None) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", "gelu")
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"ModernBERT hidden_activation {activation!r} is not supported "
                                      f"(supported: {', '.join(ACTIVATIONS)})")
        if config.hidden_size % config.num_attention_heads:
            raise NotImplementedError(f"hidden_size {config.hidden_size} is not a multiple of "
                                      f"num_attention_heads {config.num_attention_heads}")
        head_dim = config.hidden_size // config.num_attention_heads
        if getattr(config, "head_dim", None) not in (None, head_dim):
            raise NotImplementedError(f"ModernBERT head_dim {config.head_dim} other than hidden_size / heads")
        self.config = config
        kinds = _layer_types(config)
        #: half the local window: a local layer's token sees real tokens at most this many positions away
        self.window = int(config.local_attention) // 2
        # float32 inverse frequencies, kept off the module's buffers so that a bf16 model keeps them exact
        self.inv_freq = {kind: default_inv_freq(head_dim, _rope_theta(config, kind)) for kind in set(kinds)}
        self.embeddings = _Embeddings(config)
        self.layers = nn.ModuleList(_Layer(config, i, kind) for i, kind in enumerate(kinds))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        #: the longest input: the positions the model was trained on
        self.max_positions = int(config.max_position_embeddings)

    def _rotary(self, kind: str, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin [length, head_dim] of ``kind``'s layers, computed in float32 and cast to ``dtype``."""
        positions = torch.arange(length, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[kind].to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, length, hidden] of a right-padded batch (`attention_mask` 1 on real tokens)."""
        x = self.embeddings(input_ids)
        length, device = input_ids.shape[1], input_ids.device
        keys = attention_mask.bool()[:, None, None, :]  # [batch, 1, 1, length]: the real keys
        positions = torch.arange(length, device=device)
        itself = positions[:, None] == positions[None, :]  # every query sees itself: no fully masked row
        kinds = {layer.kind for layer in self.layers}
        masks = {GLOBAL: keys | itself}
        if LOCAL in kinds:
            near = (positions[:, None] - positions[None, :]).abs() <= self.window
            masks[LOCAL] = (keys & near) | itself
        rotary = {kind: self._rotary(kind, length, device, x.dtype) for kind in kinds}
        for layer in self.layers:
            x = layer(x, *rotary[layer.kind], masks[layer.kind])
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers-named tensors; raises on unknown names and on parameters left unloaded."""
        params = dict(self.named_parameters())
        pending = set(params)
        for name, tensor in weights:
            if name.startswith(self.skipped):
                continue
            name = name.removeprefix(self.prefix)
            if name not in params:
                raise ValueError(f"unexpected tensor {name!r} in a {type(self).__name__} checkpoint")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            pending.discard(name)
        if pending:
            raise ValueError(f"the checkpoint lacks {len(pending)} tensors, e.g. {sorted(pending)[:3]}")
