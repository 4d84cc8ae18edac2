"""Lightning attention, the linear attention of MiniMax-Text-01 and MiniMax-M1 (models/minimax.py), as
transformers' ``MiniMaxLightningAttention`` computes it: q, k and v are ``act(qkv_proj(h))`` split head by
head (each head's q, k and v side by side), unscaled and unnormalized, and each head keeps a float32 state
S [head_dim, head_dim] that decays by ``exp(-slope)`` a token: ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``,
its output ``o_t = q_t S_t``. The heads' outputs, RMS-normalized over all of them (eps 1e-6, ``norm``) and
gated by ``sigmoid(output_gate(h))``, go through ``out_proj``. Head ``i`` (from 0) of layer ``l`` of ``L``
decays at ``2 ** (-8 (i + 1) / heads) * (1 - l / (L - 1 + 1e-5) + 1e-5)``: deeper layers forget slower.

A decode step advances every sequence's state by its one token at once (`lightning_step`). A prompt chunk
is taken in blocks of ``block_size`` tokens (`lightning_prompt`: transformers' block form): within a block
the outputs are ``((Q K^T) * D) V``, D the decays between the block's positions, plus the state before the
block seen through each query's decay; the states at the blocks' starts are one short loop over the blocks.
Checkpoint names ``self_attn.qkv_proj``, ``output_gate``, ``norm``, ``out_proj``; the decay tables
transformers saves beside them (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``) follow
from the config and are not read."""

from __future__ import annotations

from typing import Any

import torch

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RMSNorm
from ..layers.activation import Activation
from ..layers.recurrent import (
    RecurrentLayer,
    StateSpec,
    all_single_rows,
    initial_states,
    segments,
    store_states,
)
from .llama import head_dim_of

NORM_EPS = 1e-6  # the output norm's: transformers builds it with its RMSNorm's default, whatever rms_norm_eps
DERIVED_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def slope_rates(heads: int, layer_index: int, layers: int) -> torch.Tensor:
    """Each head's decay rate [heads] in layer ``layer_index`` of ``layers`` (float32, as transformers')."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer_index / (layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(heads, dtype=torch.float32) + 1) * factor


def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k, v [B, H, D] and their states [B, H, D, D] (float32) ->
    (outputs [B, H, D], states after the token)."""
    state = state * torch.exp(-rates).view(1, -1, 1, 1) + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def lightning_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor,
                     state: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: q, k, v [L, H, D] from ``state`` [H, D, D] (float32), in blocks of
    ``block`` -> (outputs [L, H, D], the state after them)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    length = q.shape[1]
    whole = length // block * block
    outs = []
    for start, end, size in ((0, whole, block), (whole, length, length - whole)):
        if end > start:  # the whole blocks together, then the shorter last one
            out, state = _blocks(q[:, start:end], k[:, start:end], v[:, start:end], rates, state, size)
            outs.append(out)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor, state: torch.Tensor,
            size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive blocks of ``size`` tokens: q, k, v [H, n * size, D] -> (outputs [H, n * size, D], the
    state after them)."""
    heads, length, dim = q.shape
    q, k, v = (x.reshape(heads, length // size, size, dim) for x in (q, k, v))
    rate = rates.view(heads, 1, 1, 1)
    pos = torch.arange(size, device=q.device, dtype=torch.float32)
    gap = pos[:, None] - pos[None, :]  # query position - key position within the block
    diagonal = torch.exp(torch.where(gap >= 0, -rate * gap, float("-inf")))  # [H, 1, size, size]
    intra = ((q @ k.transpose(-1, -2)) * diagonal) @ v
    block_kv = (k * torch.exp(-rate * (size - 1 - pos)[:, None])).transpose(-1, -2) @ v  # [H, n, D, D]
    decay = torch.exp(-rate[:, 0] * size)  # [H, 1, 1]
    starts = []
    for index in range(block_kv.shape[1]):
        starts.append(state)
        state = state * decay + block_kv[:, index]
    inter = (q * torch.exp(-rate * (pos + 1)[:, None])) @ torch.stack(starts, dim=1)
    return (inter + intra).reshape(heads, length, dim), state


class LightningAttention(RecurrentLayer):
    """One lightning-attention layer (module docstring); ``forward(hidden, positions, meta)`` as an
    attention layer's (it reads no positions). Its state: [heads, head_dim, head_dim] float32."""

    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, head_dim_of(config)
        width = self.heads * self.head_dim
        self.block = config.block_size
        self.qkv_proj = Linear(config.hidden_size, 3 * width)
        self.act = Activation(config.hidden_act)
        self.norm = RMSNorm(width, NORM_EPS, ops)
        self.output_gate = Linear(config.hidden_size, width)
        self.out_proj = Linear(width, config.hidden_size)
        # float32 whatever the model's dtype (no buffer: a cast would round it), as the state
        self.rates = slope_rates(self.heads, layer_index, config.num_hidden_layers)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec((self.heads, self.head_dim, self.head_dim), torch.float32),)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.act(self.qkv_proj(hidden)).view(t, self.heads, 3 * self.head_dim).float()
        q, k, v = qkv.split(self.head_dim, dim=-1)
        out = self.norm(self.mix(q, k, v, meta).reshape(t, -1).to(hidden.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * out)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The heads' outputs [T, H, D] (float32) of the step's rows, each sequence from its slot's state."""
        (state,) = self.bound_states()
        segs = segments(meta)
        rates = self._rates_on(q.device)
        start = initial_states(state, segs, torch.float32)
        if all_single_rows(segs):
            out, final = lightning_step(q, k, v, rates, start)
        else:
            out = torch.empty_like(q)
            finals = []
            for i, seg in enumerate(segs):
                rows = seg.rows
                out[rows], last = lightning_prompt(q[rows], k[rows], v[rows], rates, start[i], self.block)
                finals.append(last)
            final = torch.stack(finals)
        store_states(state, segs, final)
        return out

    def _rates_on(self, device: torch.device) -> torch.Tensor:
        if self.rates.device != device:
            self.rates = self.rates.to(device)
        return self.rates
