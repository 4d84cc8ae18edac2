"""The gated DeltaNet token mixer of the hybrid models (Qwen3-Next, Qwen3.5, OLMo Hybrid), following
transformers' ``Qwen3NextGatedDeltaNet``: a `RecurrentLayer` whose state per sequence is a float32 matrix
memory ``[value heads, key_head_dim, value_head_dim]`` beside its convolution's last inputs.

Per token: q, k and v (``linear_num_key_heads`` / ``linear_num_value_heads`` heads; more value heads than key
heads share each key head's q and k, transformers' ``repeat_interleave``) go through one depthwise causal
convolution and SiLU; q and k are L2-normalized (eps 1e-6) and q scaled by ``key_head_dim ** -0.5``; the
decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and the step size ``beta = sigmoid(b)`` (times
``beta_scale``: OLMo Hybrid's 2) come from their own projections. The gated delta rule then reads and
writes the memory ``S``::

    S = exp(g) * S;  S += k (beta * (v - k S));  out = q S

and the output is RMS-normalized per head, multiplied by ``silu(z)`` (``GatedRMSNorm``) and projected back.
A decode step runs it once for every sequence at once; a prompt (or any run of several tokens) runs the
chunked form of transformers' ``torch_chunk_gated_delta_rule``: chunks of 64 tokens solved with a
triangular system each, one sequential step per chunk.

Subclasses build the input projections under their checkpoints' names (``project``): Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba``, Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``,
OLMo Hybrid's ``q_proj`` ... ``g_proj``. The convolution's weight is the checkpoints' ``conv1d.weight``
[channels, 1, kernel], over the channels [q | k | v].

``HybridDecoderLayer`` is the pre-norm layer the Qwen families and OLMo Hybrid's linear layers share: by its
``layer_types`` entry, this mixer (``linear_attn``) or attention (``self_attn``), then the MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, Linear, RMSNorm, RotaryEmbedding
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
from .llama import DecoderSpec, LlamaDecoderLayer

LAYER_TYPES = ("linear_attention", "full_attention")
CHUNK = 64  # tokens a chunk of the chunked form (transformers' chunk_size)
MAX_NATIVE_VALUE_DIM = 1024  # csrc/delta_rule.c MAX_VALUE_DIM
L2_EPS = 1e-6  # the q / k L2 norm's (transformers' l2norm, as FLA's kernels)


class GatedRMSNorm(nn.Module):
    """``weight * norm(x)`` (rounded to x's dtype first) times ``silu(gate)`` in float32, rounded once
    (transformers' ``Qwen3NextRMSNormGated``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    """The mixer, less its input projections (``project``, per family). ``norm_eps``: the output norm's;
    ``beta_scale``: what ``sigmoid(b)`` is multiplied by."""

    def __init__(self, config: Any, norm_eps: float, beta_scale: float = 1.0):
        super().__init__()
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.value_heads % self.key_heads:
            raise NotImplementedError(f"linear_num_value_heads {self.value_heads} is not a multiple of "
                                      f"linear_num_key_heads {self.key_heads}")
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.sizes = [keys, keys, values]  # the convolution's channels: q, k, v
        self.conv1d = DepthwiseConv(sum(self.sizes), self.kernel)
        self.A_log = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.value_dim, norm_eps)
        self.out_proj = Linear(values, config.hidden_size)
        self.act = Activation(config.hidden_act)
        self.beta_scale = beta_scale

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q | k | v [T, channels], z [T, value heads * value_head_dim], b and a [T, value heads])."""
        raise NotImplementedError

    def state_specs(self) -> tuple[StateSpec, ...]:
        return StateSpec((sum(self.sizes), self.kernel - 1)), StateSpec(
            (self.value_heads, self.key_dim, self.value_dim), torch.float32)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        conv_state, memory = self.bound_states()
        segs = segments(meta)
        mixed = self.act(self.conv1d(mixed, conv_state, segs))
        q, k, v = mixed.split(self.sizes, dim=-1)
        q, k = (self.heads_of(x.reshape(t, self.key_heads, self.key_dim)) for x in (q, k))
        q = q * self.key_dim**-0.5
        beta = (b.sigmoid() * self.beta_scale).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = delta_rule(q, k, v.reshape(t, self.value_heads, self.value_dim).float(), g, beta, memory, segs)
        out = self.norm(out.to(hidden.dtype), z.reshape(t, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(t, -1))

    def heads_of(self, x: torch.Tensor) -> torch.Tensor:
        """Key-head rows [T, key heads, D] L2-normalized in float32, one per value head."""
        x = x.float()
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
        return x.repeat_interleave(self.value_heads // self.key_heads, dim=1)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               memory: torch.Tensor, segs: tuple[Segment, ...]) -> torch.Tensor:
    """The gated delta rule over the step's rows (float32 q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]), each
    segment from its slot's memory [slots, H, Dk, Dv], which it then updates; returns [T, H, Dv]. Segments of
    one row take one recurrence step together; longer ones the chunked form, one after another."""
    start = initial_states(memory, segs, torch.float32)
    single = [i for i, seg in enumerate(segs) if seg.length == 1]
    if len(single) == len(segs):  # a decode step: row i is segment i's
        out, final = recurrent_step(q, k, v, g, beta, start)
        store_states(memory, segs, final)
        return out
    out = v.new_empty(v.shape)
    final = torch.empty_like(start)
    if single:
        rows = torch.tensor([segs[i].start for i in single], device=q.device)
        picked = (x[rows] for x in (q, k, v, g, beta))
        out[rows], final[single] = recurrent_step(*picked, start[single])
    for i, seg in enumerate(segs):
        if seg.length > 1:
            r = seg.rows
            out[r], final[i] = chunked(q[r], k[r], v[r], g[r], beta[r], start[i])
    store_states(memory, segs, final)
    return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   memory: torch.Tensor, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]) from its memory
    [B, H, Dk, Dv], which it updates in place: (outputs [B, H, Dv], the memory). A decode step's cost is the
    memory's traffic, so it is read once for both k S and q S, before it decays: with a = exp(g),
    delta = beta (v - a k S) and S' = a S + k delta^T, the output q S' is a q S + (q . k) delta. On the CPU the
    native kernel does it in one pass over the memory (csrc/delta_rule.c); ``native=False``: torch's ops."""
    kernels = native_step_kernels(memory, (q, k, v, g, beta), MAX_NATIVE_VALUE_DIM) if native else None
    if kernels is not None:
        out = v.new_empty(v.shape)
        contiguous = [x.contiguous() for x in (q, k, v, g, beta)]
        dk, dv = memory.shape[-2:]
        kernels.call("core_delta_rule_step", *(x.data_ptr() for x in contiguous), memory.data_ptr(),
                       memory.numel() // (dk * dv), dk, dv, out.data_ptr())
        return out, memory
    decay = g.exp().unsqueeze(-1)  # [B, H, 1]
    k_read, q_read = (torch.stack([k, q], dim=-2) @ memory).unbind(-2)  # [B, H, Dv] each
    delta = (v - decay * k_read) * beta.unsqueeze(-1)
    out = decay * q_read + (q * k).sum(-1, keepdim=True) * delta
    dk, dv = memory.shape[-2:]
    memory.mul_(decay.unsqueeze(-1)).view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    return out, memory


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            memory: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens (q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H]) from its memory [H, Dk, Dv]:
    (outputs [L, H, Dv], the memory after them), in chunks of ``chunk`` tokens as transformers'
    ``torch_chunk_gated_delta_rule`` computes them, the last one shorter where L is not a multiple (transformers
    pads it with zeros, which neither decay nor write the memory: the same sums)."""
    length = q.shape[0]
    whole = length - length % chunk
    if 0 < whole < length:  # whole chunks, then the rest as one short chunk: nothing is computed on padding
        out, memory = chunked(q[:whole], k[:whole], v[:whole], g[:whole], beta[:whole], memory, chunk)
        rest, memory = chunked(q[whole:], k[whole:], v[whole:], g[whole:], beta[whole:], memory, chunk)
        return torch.cat([out, rest]), memory
    chunk = min(chunk, length)  # now a whole number of chunks
    heads = q.shape[1]
    # [H, N, C, D], contiguous once: the products below then read k transposed in place, never a copy of it
    q, k, v = (x.transpose(0, 1).reshape(heads, -1, chunk, x.shape[-1]).contiguous() for x in (q, k, v))
    g, beta = (x.transpose(0, 1).reshape(heads, -1, chunk) for x in (g, beta))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start through each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # its strict lower triangle: the UT transform's
    inner = (q @ k.transpose(-1, -2)) * pairwise
    # the UT transform's inverse (I + strict lower triangle of system)^-1 [H, N, C, C], as transformers builds it,
    # then applied to both right-hand sides: a C x C solve, not one of C x (Dv + Dk), and no concatenation
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    values, keys = inverse @ v_beta, inverse @ (k_beta * decay.exp().unsqueeze(-1))
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(q.shape[1]):
        fresh = values[:, i] - keys[:, i] @ memory  # what the memory does not predict yet
        out[:, i] = q[:, i] @ memory + inner[:, i] @ fresh
        memory = memory * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1]).transpose(0, 1), memory


def hybrid_layer_types(config: Any, family: str) -> list[str]:
    """``config.layer_types``; NotImplementedError names those neither a gated DeltaNet nor full attention."""
    types = list(config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"{family}: layer_types {unknown} are not supported "
                                  f"(supported: {LAYER_TYPES})")
    return types


class HybridDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its (hidden, residual) protocol, ``make_mlp``) whose token mixer is, by the
    layer's ``layer_types`` entry, a ``mixer_class`` (``linear_attn``) or an ``attention_class``
    (``self_attn``); its two norms are ``norm_class``'s."""

    mixer_class: type[GatedDeltaNet]  # built as mixer_class(config)
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding | None):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: attention in some layers only
        linear = config.layer_types[layer_index] == "linear_attention"
        self.linear_attn = self.mixer_class(config) if linear else None
        self.self_attn = None if linear else self.attention_class(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, spec, layer_index)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = self.normed_input(hidden, residual)
        if self.self_attn is None:
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(hidden, positions, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
