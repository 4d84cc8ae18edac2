"""The Mamba-1 selective-state-space mixer that Mamba, FalconMamba and Jamba's Mamba layers share, as
transformers' ``MambaMixer`` computes it: ``in_proj`` gives x and the gate z (``intermediate`` values each);
x goes through a depthwise causal convolution (``layers/recurrent.causal_conv1d``, its last ``kernel - 1``
inputs kept per sequence) and the config's activation (SiLU); ``x_proj`` gives a low-rank time step, B and C
(``state`` values each); ``dt = softplus(dt_proj(time step))``, one per channel. Each channel keeps a float32
state of ``state`` values: ``h = exp(dt * A) h + dt * x B``, ``y = h C + D x``, with ``A = -exp(A_log)``
([intermediate, state]); ``y * silu(z)`` goes back through ``out_proj``. FalconMamba RMS-normalizes the time
step, B and C (no weights, ``mixer_rms_eps``) before ``dt_proj``; Jamba does the same with weights
(``dt_layernorm``, ``b_layernorm``, ``c_layernorm``, ``rms_norm_eps``).

A decode step advances every sequence's state once, together. A prompt runs a prefix scan in blocks of tokens
(``SCAN_BLOCK_ELEMENTS``), each from the state the block before left: each token's (decay, inflow) pair
composes with the one ``2^k`` tokens before it, log2(block) steps over the whole block. The decay is per
channel and state value, not per head as in Mamba-2, so the masked-attention chunk form would cost ``chunk^2 *
intermediate * state`` a chunk, and the cumulative-sum factorization ``exp(S_t) * cumsum(exp(-S_s) *
inflow_s)`` overflows float32 where a chunk's decay passes e^-88 in any channel (one token of a trained
model's fast channels can); the scan only multiplies decays in (0, 1].

Checkpoint names are transformers': ``in_proj``, ``conv1d.weight`` [intermediate, 1, kernel] (and
``conv1d.bias``), ``x_proj``, ``dt_proj`` (with its bias), ``A_log``, ``D``, ``out_proj``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, Linear, RMSNorm
from ..layers.recurrent import (
    DepthwiseConv,
    RecurrentLayer,
    Segment,
    StateSpec,
    all_single_rows,
    initial_states,
    segments,
    store_states,
)

#: Values of one [tokens, intermediate, state] tensor a prompt's scan holds at once (1 MiB of float32): the
#: scan is bound by memory traffic, and blocks that stay in a CPU's cache ran fastest. On one core of a busy
#: 2-core EPYC: Mamba-130m's width (1536 x 16), 2,000 tokens, 0.68 s in 10-token blocks, 1.56 s in 85-token
#: ones, 1.02 s as transformers runs it (a loop over tokens on whole-prompt tensors); FalconMamba-7B's
#: (8192 x 16), 256 tokens, 0.23 s in 2-token blocks, 1.01 s in 16-token ones, 0.58 s transformers'; a tiny
#: model's (128 x 16) 0.076 s in 128-token blocks.
SCAN_BLOCK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class MixerSizes:
    """One family's Mamba-1 mixer, read from its config by the family's model file."""

    hidden_size: int
    intermediate: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    bias: bool  # in_proj's and out_proj's
    conv_bias: bool
    activation: str  # after the convolution


class MambaMixer(RecurrentLayer):
    """Mamba's mixer: ``forward(hidden [T, H], meta) -> [T, H]``, its states bound by the runner."""

    def __init__(self, sizes: MixerSizes):
        super().__init__()
        self.sizes = sizes
        inter, state = sizes.intermediate, sizes.state_size
        self.in_proj = Linear(sizes.hidden_size, 2 * inter, bias=sizes.bias)
        self.conv1d = DepthwiseConv(inter, sizes.conv_kernel, sizes.conv_bias)
        self.act = Activation(sizes.activation)
        self.x_proj = Linear(inter, sizes.dt_rank + 2 * state, bias=False)
        self.dt_proj = Linear(sizes.dt_rank, inter, bias=True)
        self.A_log = nn.Parameter(torch.empty(inter, state), requires_grad=False)
        self.D = nn.Parameter(torch.empty(inter), requires_grad=False)
        self.out_proj = Linear(inter, sizes.hidden_size, bias=sizes.bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The convolution's last inputs, then the SSM state (float32)."""
        sizes = self.sizes
        return (StateSpec((sizes.intermediate, sizes.conv_kernel - 1)),
                StateSpec((sizes.intermediate, sizes.state_size), torch.float32))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        segs = segments(meta)
        conv_state, ssm_state = self.bound_states()
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        x = self.act(self.conv1d(x, conv_state, segs))
        dt, B, C = self.selection(x)
        y = self.scan(x, dt, B, C, ssm_state, segs)
        # in float32, as transformers' prompt path adds the skip and gates (its decode step rounds between)
        y = (y.float() + x * self.D.float()) * F.silu(gate)
        return self.out_proj(y.to(hidden.dtype))

    def selection(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dt [T, inter] float32, B [T, state], C [T, state]) of the convolved inputs."""
        sizes = self.sizes
        step, B, C = self.x_proj(x).split((sizes.dt_rank, sizes.state_size, sizes.state_size), dim=-1)
        step, B, C = self.normalized(step, B, C)
        return F.softplus(self.dt_proj(step).float()), B, C

    def normalized(self, step: torch.Tensor, B: torch.Tensor, C: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The time step, B and C before ``dt_proj`` (FalconMamba and Jamba normalize them)."""
        return step, B, C

    def scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ssm_state: torch.Tensor, segs: tuple[Segment, ...]) -> torch.Tensor:
        """``h C`` [T, inter] of every row, each segment from its slot's state, which it then updates."""
        A = -torch.exp(self.A_log.float())
        start = initial_states(ssm_state, segs, torch.float32)
        if all_single_rows(segs):
            states = advance(*discretized(x, dt, A, B), start)
            store_states(ssm_state, segs, states)
            return readout(states, C)
        out = torch.empty_like(x)
        finals = []
        for i, seg in enumerate(segs):
            rows = seg.rows
            out[rows], final = selective_scan(x[rows], dt[rows], A, B[rows], C[rows], start[i])
            finals.append(final)
        store_states(ssm_state, segs, torch.stack(finals))
        return out


class FalconMambaMixer(MambaMixer):
    """FalconMamba's: the time step, B and C RMS-normalized without weights (``mixer_rms_eps``)."""

    def __init__(self, sizes: MixerSizes, eps: float):
        super().__init__(sizes)
        self.eps = eps

    def normalized(self, step: torch.Tensor, B: torch.Tensor, C: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rms(step), self.rms(B), self.rms(C)

    def rms(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` RMS-normalized in float32, back in its dtype."""
        return torch.rms_norm(t.float(), t.shape[-1:], None, self.eps).to(t.dtype)


class JambaMambaMixer(MambaMixer):
    """Jamba's: the time step, B and C RMS-normalized with weights (``rms_norm_eps``)."""

    def __init__(self, sizes: MixerSizes, ops: Any, eps: float):
        super().__init__(sizes)
        self.dt_layernorm = RMSNorm(sizes.dt_rank, eps, ops)
        self.b_layernorm = RMSNorm(sizes.state_size, eps, ops)
        self.c_layernorm = RMSNorm(sizes.state_size, eps, ops)

    def normalized(self, step: torch.Tensor, B: torch.Tensor, C: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dt_layernorm(step), self.b_layernorm(B), self.c_layernorm(C)


def discretized(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (decay ``exp(dt * A)``, inflow ``dt * x * B``), both [rows, inter, state] float32."""
    return torch.exp(dt.unsqueeze(-1) * A), (dt * x).unsqueeze(-1) * B.unsqueeze(1)


def advance(decay: torch.Tensor, inflow: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``decay * state + inflow``."""
    return torch.addcmul(inflow, decay, state)


def readout(states: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``h C`` of each row's state [rows, inter, state], in C's dtype (transformers rounds h to it first)."""
    return (states.to(C.dtype) @ C.unsqueeze(-1)).squeeze(-1)


def prefix_scan(decay: torch.Tensor, inflow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``h_t = decay_t h_(t-1) + inflow_t`` along dim 0: (the decays' running products, h_t from a zero
    state). Each row composes with the row ``step`` before it, ``step`` doubling (Hillis and Steele)."""
    step = 1
    while step < len(decay):
        inflow = torch.cat((inflow[:step], torch.addcmul(inflow[step:], decay[step:], inflow[:-step])))
        decay = torch.cat((decay[:step], decay[step:] * decay[:-step]))
        step *= 2
    return decay, inflow


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows from ``state`` [inter, state]: (``h C`` [T, inter], the state after its last
    row)."""
    block = max(1, SCAN_BLOCK_ELEMENTS // A.numel())
    outs = []
    for start in range(0, len(x), block):
        rows = slice(start, start + block)
        decay, inflow = prefix_scan(*discretized(x[rows], dt[rows], A, B[rows]))
        states = advance(decay, inflow, state)
        outs.append(readout(states, C[rows]))
        state = states[-1]
    return torch.cat(outs), state
