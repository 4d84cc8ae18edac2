"""The Mamba-2 mixer (state space duality, SSD) that Mamba-2, Granite 4.0-H, Bamba, Nemotron-H and Falcon-H1
share, as transformers' ``Mamba2Mixer`` computes it: ``in_proj`` gives the gate z, the convolved inputs xBC and
one time step per head; xBC goes through a depthwise causal convolution (``layers/recurrent.causal_conv1d``,
its last ``kernel - 1`` inputs kept per sequence) and SiLU, then splits into x (heads x head_dim), B and C
(``groups`` x state_size, each group shared by ``heads / groups`` heads). Each head keeps a float32 state
[head_dim, state_size]: ``h = exp(dt * A) h + dt * x B^T``, ``y = h C + D x``, with ``dt = softplus(dt +
dt_bias)`` and ``A = -exp(A_log)``. A prompt runs the chunked form (chunks of at most ``PROMPT_CHUNK``: within a
chunk as masked attention, across chunks through the states), decode rows one step for the whole batch.
``y`` is then normalized with the gate (RMS per group of ``inter / groups`` values; SiLU(z) before the norm,
or after it for Falcon-H1's ``mamba_norm_before_gate``) and projected back by ``out_proj``.

``time_step_limit`` clamps dt in the chunked form only: transformers' and mamba_ssm's step functions do not
clamp (at its default, (0, inf), the clamp does nothing). transformers runs a whole prompt in the chunked form,
so a prompt token alone in its chunk (``AttentionMetadata.prompt_singletons``) runs it too, clamped, never the
step: a prompt's text must not depend on where the scheduler cut it. Checkpoint names are transformers': ``in_proj``, ``conv1d.weight`` [channels, 1, kernel]
(and ``conv1d.bias``), ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, Linear
from ..layers.recurrent import (
    DepthwiseConv,
    RecurrentLayer,
    Segment,
    StateSpec,
    initial_states,
    native_step_kernels,
    segments,
    store_states,
)

# The chunked form's chunk: any size gives the same sums but for rounding; the work within a chunk grows with its
# square. Configs say 256 (the GPU kernels'); on a 2-core Zen 4 EPYC a 1,024-token prompt of a Granite-4.0-H
# layer (48 heads, one thread) took 232-290 ms at 256 and 58 ms at 64, both within 4e-7 of a float64 reference.
PROMPT_CHUNK = 64
MAX_NATIVE_STATE = 1024  # csrc/ssd_step.c MAX_STATE


@dataclass(frozen=True)
class MixerSpec:
    """One family's Mamba-2 mixer, read from its config by the family's model file."""

    hidden_size: int
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    chunk_size: int
    norm_eps: float
    activation: str = "silu"  # after the convolution
    conv_bias: bool = True
    in_bias: bool = False
    out_bias: bool = False
    time_step_limit: tuple[float, float] | None = None  # None: no clamp
    gated_norm: bool = True  # Falcon-H1's mamba_rms_norm False: y * silu(z), no norm
    norm_before_gate: bool = False

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_size

    def check(self) -> None:
        """NotImplementedError naming the config field where a shape cannot be served."""
        if self.heads % self.groups:
            raise NotImplementedError(f"Mamba-2: n_groups {self.groups} does not divide the {self.heads} heads")
        if self.activation not in ("silu", "swish"):
            raise NotImplementedError(f"Mamba-2: the convolution's activation {self.activation!r} is not supported "
                                      "(hidden_act / mamba_hidden_act: silu)")


def time_step_limit_of(limit) -> tuple[float, float] | None:
    """A config's ``time_step_limit`` as a clamp, None where it clamps nothing after softplus ((0, inf))."""
    if limit is None:
        return None
    low, high = float(limit[0]), float(limit[1])
    return None if low <= 0.0 and math.isinf(high) else (low, high)


class GatedRMSNorm(nn.Module):
    """RMS norm over groups of ``size / groups`` values, gated by SiLU(z) before it (Mamba-2's) or after it
    (``norm_before_gate``: Falcon-H1's), in float32."""

    def __init__(self, size: int, groups: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gate = F.silu(z.float())
        y = y.float() if self.norm_before_gate else y.float() * gate
        grouped = y.view(*y.shape[:-1], self.groups, -1)
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).view(y.shape)
        if self.norm_before_gate:
            return (self.weight.float() * y * gate).to(dtype)
        return self.weight * y.to(dtype)


class Mamba2Mixer(RecurrentLayer):
    """``forward(hidden [T, hidden_size], meta) -> [T, hidden_size]``; states: the convolution's last inputs
    [channels, kernel - 1] (model dtype) and the SSM state [heads, head_dim, state_size] (float32)."""

    def __init__(self, spec: MixerSpec):
        super().__init__()
        spec.check()
        self.spec = spec
        self.in_proj = Linear(spec.hidden_size, spec.inner + spec.conv_channels + spec.heads, bias=spec.in_bias)
        self.conv1d = DepthwiseConv(spec.conv_channels, spec.conv_kernel, spec.conv_bias)
        self.act = Activation(spec.activation)
        self.dt_bias = nn.Parameter(torch.empty(spec.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(spec.heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(spec.heads), requires_grad=False)
        self.norm = (GatedRMSNorm(spec.inner, spec.groups, spec.norm_eps, spec.norm_before_gate)
                     if spec.gated_norm else None)
        self.out_proj = Linear(spec.inner, spec.hidden_size, bias=spec.out_bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        spec = self.spec
        return (StateSpec((spec.conv_channels, spec.conv_kernel - 1)),
                StateSpec((spec.heads, spec.head_dim, spec.state_size), torch.float32))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``in_proj(hidden)``: [z | xBC | dt] (Falcon-H1 scales its input and parts)."""
        return self.in_proj(hidden)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        spec = self.spec
        conv_state, ssm_state = self.bound_states()
        segs = segments(meta)
        z, xbc, dt = self.project(hidden).split([spec.inner, spec.conv_channels, spec.heads], dim=-1)
        xbc = self.act(self.conv1d(xbc, conv_state, segs))
        x, b, c = xbc.split([spec.inner, spec.groups * spec.state_size, spec.groups * spec.state_size], dim=-1)
        t = hidden.shape[0]
        y = self.scan(x.reshape(t, spec.heads, spec.head_dim).float(), b.reshape(t, spec.groups, -1).float(),
                      c.reshape(t, spec.groups, -1).float(), dt.float(), ssm_state, segs,
                      prompt_rows(meta)).view(t, spec.inner)
        y = self.norm(y, z, hidden.dtype) if self.norm is not None else (y * F.silu(z.float())).to(hidden.dtype)
        return self.out_proj(y)

    def scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, ssm_state: torch.Tensor,
             segs: tuple[Segment, ...], prompts_at: frozenset[int] = frozenset()) -> torch.Tensor:
        """The SSM over every segment (x [T, heads, head_dim], b and c [T, groups, state], dt [T, heads], all
        float32): the rows that continue a sequence by one generated token in one batched step, the others
        (prompts, their chunks, a prompt token alone at a row of ``prompts_at``) one sequence at a time in the
        chunked form. Returns y [T, heads, head_dim] (D x added)."""
        a = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias.float())
        y = torch.empty_like(x)
        steps = tuple(s for s in segs if s.length == 1 and not s.fresh and s.start not in prompts_at)
        if steps:
            rows = torch.tensor([s.start for s in steps], device=x.device)
            state = initial_states(ssm_state, steps, torch.float32)
            y[rows] = ssd_step(state, x[rows], dt[rows], a, b[rows], c[rows])
            store_states(ssm_state, steps, state)
        prompts = tuple(s for s in segs if s not in steps)
        if prompts:
            if self.spec.time_step_limit is not None:
                dt = dt.clamp(*self.spec.time_step_limit)
            starts = initial_states(ssm_state, prompts, torch.float32)
            finals = []
            for seg, start in zip(prompts, starts, strict=True):
                rows = seg.rows
                y[rows], final = ssd_chunked(x[rows], dt[rows], a, b[rows], c[rows], start,
                                             min(self.spec.chunk_size, PROMPT_CHUNK))
                finals.append(final)
            store_states(ssm_state, prompts, torch.stack(finals))
        return y + x * self.D.float()[:, None]


def prompt_rows(meta: AttentionMetadata) -> frozenset[int]:
    """The rows of the prompt tokens alone in their chunks (``prompt_singletons``), which the scan runs as
    prompts: transformers clamps a whole prompt's time steps, however the scheduler cut it."""
    starts = meta.row_starts()
    return frozenset(starts[b] for b in meta.prompt_singletons)


def _per_head(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [..., groups, state] repeated for each head of its group: [..., heads, state]."""
    return bc.repeat_interleave(heads // bc.shape[-2], dim=-2)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, native: bool = True) -> torch.Tensor:
    """One token of each of B sequences: updates ``state`` [B, heads, head_dim, state] in place and returns
    y [B, heads, head_dim] (without D x); x [B, heads, head_dim], dt [B, heads], b and c [B, groups, state].
    On the CPU the native kernel does it in one pass over the state (csrc/ssd_step.c); ``native=False``:
    torch's ops."""
    heads, head_dim, size = state.shape[1:]
    kernels = native_step_kernels(state, (x, dt, a, b, c), MAX_NATIVE_STATE) if native else None
    if kernels is not None:
        y = x.new_empty(x.shape)
        inputs = [t.contiguous() for t in (x, dt, a, b, c)]
        kernels.call("core_ssd_step", *(t.data_ptr() for t in inputs), state.data_ptr(), state.shape[0],
                              heads, b.shape[-2], head_dim, size, y.data_ptr())
        return y
    decay = torch.exp(dt * a)[..., None, None]
    inflow = dt[..., None] * _per_head(b, heads)  # [B, heads, state]
    # state = decay * state + x inflow^T, the outer product added in place (the state is a decode step's traffic)
    state.mul_(decay).view(-1, head_dim, size).baddbmm_(x.reshape(-1, head_dim, 1), inflow.reshape(-1, 1, size))
    return (state @ _per_head(c, heads)[..., None])[..., 0]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., T, T]: entry (i, j) the sum of ``a[..., j + 1 : i + 1]`` for j <= i, -inf above the diagonal
    (cumulative sums of masked copies, not differences of cumsums, which lose precision)."""
    t = a.shape[-1]
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a[..., None].expand(*a.shape, t).masked_fill(~below, 0), dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones_like(below), diagonal=0), -torch.inf)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                start: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens in chunks of ``chunk`` (the SSD algorithm, transformers' torch form): x [L,
    heads, head_dim], dt [L, heads], b and c [L, groups, state], ``start`` its state [heads, head_dim, state].
    Returns (y [L, heads, head_dim] without D x, the state after the last token)."""
    length, heads, _ = x.shape
    whole = length - length % chunk
    if 0 < whole < length:  # whole chunks, then the rest as one short chunk: nothing is computed on padding
        y, state = ssd_chunked(x[:whole], dt[:whole], a, b[:whole], c[:whole], start, chunk)
        rest, state = ssd_chunked(x[whole:], dt[whole:], a, b[whole:], c[whole:], state, chunk)
        return torch.cat([y, rest]), state
    chunk = min(chunk, length)  # now a whole number of chunks

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [chunks, chunk, ...]
        return t.reshape(-1, chunk, *t.shape[1:])

    groups = b.shape[-2]
    per = heads // groups  # heads g * per ... g * per + per - 1 share group g's B and C
    xs = chunks(x * dt[..., None]).unflatten(2, (groups, per))  # [chunks, chunk, groups, per, head_dim]
    bs, cs = chunks(b), chunks(c)  # [chunks, chunk, groups, state]: C B^T once a group, not once a head
    log_decay = chunks(a * dt).permute(2, 0, 1)  # [heads, chunks, chunk]
    decays = torch.cumsum(log_decay, dim=-1)  # log decay from each chunk's start

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [heads, ...] -> [groups, per, ...]
        return t.unflatten(0, (groups, per))

    within = by_group(torch.exp(_segment_sums(log_decay)))  # [groups, per, chunks, l, s]: decay from s to l
    scores = within * torch.einsum("clgn,csgn->gcls", cs, bs)[:, None]
    y = torch.einsum("grcls,csgrp->clgrp", scores, xs)
    to_end = by_group(torch.exp(decays[..., -1:] - decays))  # [groups, per, chunks, chunk]
    states = torch.einsum("clgn,grcl,clgrp->cgrpn", bs, to_end, xs).flatten(1, 2)  # each chunk's own contribution
    states = torch.cat([start[None], states])
    across = torch.exp(_segment_sums(F.pad(decays[..., -1], (1, 0))))  # [heads, chunks + 1, chunks + 1]
    states = torch.einsum("hij,jhpn->ihpn", across, states)  # the state entering each chunk, then the final one
    entering = states[:-1].unflatten(1, (groups, per))
    y = y + torch.einsum("clgn,cgrpn,grcl->clgrp", cs, entering, by_group(torch.exp(decays)))
    return y.reshape(-1, heads, x.shape[-1]), states[-1]


def mamba_fields_spec(config: Any, inner: int | None = None, **overrides: Any) -> MixerSpec:
    """The mixer of a hybrid config that names its fields ``mamba_*`` (Bamba, Granite 4.0-H, Falcon-H1;
    ``inner``: heads x head_dim where the config sizes it apart from ``mamba_expand * hidden_size``)."""
    inner = inner or int(config.mamba_expand * config.hidden_size)
    if inner != config.mamba_n_heads * config.mamba_d_head:
        raise NotImplementedError(f"Mamba-2: the mixer's width {inner} is not mamba_n_heads * mamba_d_head "
                                  f"({config.mamba_n_heads} x {config.mamba_d_head})")
    fields = dict(hidden_size=config.hidden_size, heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
                  state_size=config.mamba_d_state, groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv,
                  chunk_size=config.mamba_chunk_size, norm_eps=config.rms_norm_eps, activation=config.hidden_act,
                  conv_bias=bool(config.mamba_conv_bias), in_bias=bool(config.mamba_proj_bias),
                  out_bias=bool(config.mamba_proj_bias), time_step_limit=time_step_limit_of(config.time_step_limit))
    return MixerSpec(**{**fields, **overrides})


MAMBA_LAYER_TYPES = ("linear_attention", "mamba")  # transformers' name, and the older one configs still carry
ATTENTION_LAYER_TYPES = ("full_attention", "attention")


def is_mamba_layer(layer_types: list[str], index: int, field: str = "layer_types") -> bool:
    """Whether layer ``index`` of ``layer_types`` is a Mamba-2 layer (else attention); other kinds refused."""
    kind = layer_types[index]
    if kind not in MAMBA_LAYER_TYPES + ATTENTION_LAYER_TYPES:
        raise NotImplementedError(f"{field}[{index}] {kind!r} is not supported "
                                  f"(supported: {', '.join(MAMBA_LAYER_TYPES + ATTENTION_LAYER_TYPES)})")
    return kind in MAMBA_LAYER_TYPES
