"""Kimi Linear (``KimiLinearForCausalLM``: moonshotai/Kimi-Linear-48B-A3B-Base and -Instruct): Llama's
pre-norm layers whose token mixer is, by ``layer_types``, Kimi Delta Attention (``linear_attention``: 20 of
the 27 layers) or multi-head latent attention (``full_attention``: every fourth and the last), and whose MLP
is, by ``mlp_layer_types``, a dense SwiGLU MLP of ``intermediate_size`` (``dense``: the first layer) or
DeepSeek-V3's mixture of experts (``sparse``: models/grouped_router.py, ``noaux_tc`` routing and a shared
expert; the config's ``num_experts`` are V3's ``n_routed_experts``). The released configs name the layers
in ``linear_attn_config`` (1-indexed ``kda_layers`` / ``full_attn_layers``), which transformers' config
turns into ``layer_types``.

The MLA layers are models/deepseek_v2.py's ``MlaAttention``, served as plain multi-head attention over the
expanded heads, without rotary: transformers' ``KimiLinearAttention`` rotates nothing (NoPE), the shared
``qk_rope_head_dim`` key part included (a config whose ``mla_use_nope`` is false is refused); softmax scale
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.

Kimi Delta Attention, as transformers' ``KimiLinearDeltaAttention``: the gated delta rule with a decay per
key channel. q, k and v (``linear_num_heads`` heads of ``linear_head_dim``) each go through a depthwise causal
convolution of ``linear_conv_kernel_dim`` (``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` [channels, 1, kernel])
and SiLU; q and k are L2-normalized (eps 1e-6, as FLA: ``x / sqrt(sum x^2 + eps)``), q scaled by
``linear_head_dim ** -0.5``. The decay ``g = -exp(A_log) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)`` has
one value per head and key channel, the step ``beta = sigmoid(b_proj(h))`` one per head. Each head's float32
memory S [key channels, value channels] then goes, token by token::

    S = exp(g)[:, None] * S;  S += k (beta * (v - k S));  out = q S

and the output is RMS-normalized per head (``rms_norm_eps``), times ``sigmoid(g_b_proj(g_a_proj(h)))``,
through ``o_proj``. A decode step runs that once for every sequence at once (`kda_step`); a prompt chunk runs
the chunked form of transformers' ``chunk_kimi_delta_attention`` (`kda_prompt`: chunks of 32 tokens, each a
unit lower triangular system, one state update per chunk). ``dt_bias`` stays float32 in a bfloat16 model, as
transformers keeps it (``_keep_in_fp32_modules_strict``).

Checkpoint names as the released ones (and transformers' saves): ``self_attn.*`` for both mixers (KDA's
``A_log`` [1, 1, heads, 1], ``dt_bias``, ``f_a_proj`` ... ``o_norm``), ``block_sparse_moe`` with Mixtral's
expert names (``w1`` / ``w3`` / ``w2``), ``shared_experts``, ``gate.e_score_correction_bias``; the dense
first layer's MLP under ``mlp`` or ``block_sparse_moe``; ``lm_head`` always its own (transformers never ties
it, whatever ``tie_word_embeddings`` says)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, LMHead, MergedLinear, RMSNorm
from ..layers.activation import Activation
from ..layers.recurrent import (
    DepthwiseConv,
    RecurrentLayer,
    StateSpec,
    all_single_rows,
    causal_conv1d,
    initial_states,
    segments,
    store_states,
)
from ..quant.attach import QuantizedShards
from .deepseek_v2 import MlaAttention
from .grouped_router import GroupedMoeBlock, GroupedMoeCheckpoint, noaux_tc_routing
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .mixtral import RENAMED
from .names import parts_renamed

LAYER_TYPES = ("full_attention", "linear_attention")
# tokens a chunk of a prompt's delta rule: transformers' and FLA's are 64, but each chunk holds a
# [heads, C, C, key channels] tensor of decays, so a token costs C: a 2,000-token prompt of 16 heads of 128
# took 1.9 s a layer in chunks of 32 against 5.0 s in chunks of 64 (one thread), the same values
CHUNK = 32
L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's L2 normalization of the last dimension (``+ eps`` under the root, not ``max``)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (float32): q, k, g [B, H, Dk], v [B, H, Dv], beta [B, H], their
    states [B, H, Dk, Dv] -> (outputs [B, H, Dv], states after the token)."""
    state = state * g.exp().unsqueeze(-1)
    delta = (v - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def kda_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens (float32): q, k, g [L, H, Dk], v [L, H, Dv], beta [L, H], from ``state``
    [H, Dk, Dv] -> (outputs [L, H, Dv], the state after them), ``chunk`` tokens at a time."""
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, L, D]
    beta = beta.t()
    outs = []
    for start in range(0, q.shape[1], chunk):
        rows = slice(start, start + chunk)
        out, state = _kda_chunk(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], state)
        outs.append(out)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens at once (transformers' chunk form): q, k, g [H, C, Dk], v [H, C, Dv], beta [H, C]."""
    size = q.shape[1]
    decay = g.cumsum(dim=1)  # [H, C, Dk]: each channel's log decay from the chunk's start
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # [H, C, C, Dk]: key j's channels decayed to position i >= j (zero for j > i), the one tensor of that size
    decayed = (decay.unsqueeze(2) - decay.unsqueeze(1)).masked_fill_(~causal[..., None], float("-inf")).exp_()
    decayed = decayed.mul_(k.unsqueeze(1))
    k_beta = k * beta.unsqueeze(-1)
    mixing = (decayed @ k_beta.unsqueeze(-1)).squeeze(-1).tril(-1)  # [H, C, C]
    # (I + mixing)^-1 of the chunk's beta-weighted values and decayed keys: the WY form of its updates
    targets = torch.cat((v * beta.unsqueeze(-1), k_beta * decay.exp()), dim=-1)
    solved = torch.linalg.solve_triangular(mixing, targets, upper=False, unitriangular=True)
    values, decayed_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    new = values - decayed_keys @ state
    scores = (decayed @ q.unsqueeze(-1)).squeeze(-1)  # [H, C, C], zero above the diagonal
    out = (q * decay.exp()) @ state + scores @ new
    last = decay[:, -1:]  # [H, 1, Dk]
    state = state * last.transpose(1, 2).exp() + (k * (last - decay).exp()).transpose(1, 2) @ new
    return out, state


class SigmoidGatedRMSNorm(nn.Module):
    """transformers' ``KimiLinearRMSNormGated``: RMSNorm in float32 (weight too), times ``sigmoid(gate)``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps)
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(RecurrentLayer):
    """One Kimi Delta Attention layer (module docstring); ``forward(hidden, positions, meta)`` as an
    attention layer's (it reads no positions). States: the convolutions' last inputs
    [3 x heads x head_dim, kernel - 1] (q, k and v channels in that order) and the delta rule's memory
    [heads, head_dim, head_dim] (float32)."""

    def __init__(self, config: Any, ops: Any):
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        self.width, self.kernel = self.heads * self.head_dim, config.linear_conv_kernel_dim
        self.qkv_proj = MergedLinear(hidden, [self.width] * 3, ("q", "k", "v"))  # the checkpoints' q/k/v_proj
        self.q_conv1d = DepthwiseConv(self.width, self.kernel)
        self.k_conv1d = DepthwiseConv(self.width, self.kernel)
        self.v_conv1d = DepthwiseConv(self.width, self.kernel)
        self.act = Activation(config.hidden_act)
        self.f_a_proj = Linear(hidden, self.head_dim)
        self.f_b_proj = Linear(self.head_dim, self.width)
        self.A_log = nn.Parameter(torch.empty(1, 1, self.heads, 1), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.width, dtype=torch.float32), requires_grad=False)
        self.b_proj = Linear(hidden, self.heads)
        self.g_a_proj = Linear(hidden, self.head_dim)
        self.g_b_proj = Linear(self.head_dim, self.width)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(self.width, hidden)

    def _apply(self, fn, recurse=True):
        """``dt_bias`` stays float32 whatever dtype the model takes (transformers keeps it so)."""
        super()._apply(fn, recurse)
        self.dt_bias.data = self.dt_bias.data.float()
        return self

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec((3 * self.width, self.kernel - 1)),
                StateSpec((self.heads, self.head_dim, self.head_dim), torch.float32))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        conv_state, state = self.bound_states()
        segs = segments(meta)
        t = hidden.shape[0]
        weight = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)).squeeze(1)
        qkv = self.act(causal_conv1d(self.qkv_proj(hidden), weight, None, conv_state, segs))
        q, k, v = (x.float().view(t, self.heads, self.head_dim) for x in qkv.split(self.width, dim=-1))
        q, k = l2norm(q) * (1 / self.head_dim**0.5), l2norm(k)
        g, beta = self.forget_gate(hidden), torch.sigmoid(self.b_proj(hidden)).float()
        start = initial_states(state, segs, torch.float32)
        if all_single_rows(segs):
            out, final = kda_step(q, k, v, g, beta, start)
        else:
            out = torch.empty_like(v)
            finals = []
            for i, seg in enumerate(segs):
                rows = seg.rows
                out[rows], last = kda_prompt(q[rows], k[rows], v[rows], g[rows], beta[rows], start[i])
                finals.append(last)
            final = torch.stack(finals)
        store_states(state, segs, final)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(t, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out.to(hidden.dtype), gate).reshape(t, self.width))

    def forget_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The log decay g [T, heads, head_dim] (float32), with transformers' softplus (``x`` above 20)."""
        x = self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()
        x = x.view(-1, self.heads, self.head_dim)
        softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
        return -torch.exp(self.A_log.float().view(self.heads, 1)) * softplus


class Unrotated(nn.Module):
    """The rotary slot of ``MlaAttention`` in Kimi Linear's NoPE MLA layers: q and k pass through."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class KimiLinearDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose ``self_attn`` is KDA or MLA and whose MLP is dense or experts (module
    docstring)."""

    attention_class = MlaAttention

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: nn.Module):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: the mixer differs by layer
        if config.layer_types[layer_index] == "linear_attention":
            self.self_attn: nn.Module = KimiDeltaAttention(config, ops)
        else:
            self.self_attn = self.attention_class(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, spec, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if config.mlp_layer_types[layer_index] == "dense":
            return LlamaMLP(config, ops)
        return GroupedMoeBlock(config, ops, noaux_tc_routing(config))


class KimiLinearModel(LlamaModel):
    layer_class = KimiLinearDecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[nn.Module]:  # type: ignore[override]
        return [Unrotated()] * config.num_hidden_layers


class KimiLinearForCausalLM(GroupedMoeCheckpoint, LlamaForCausalLM):
    model_class = KimiLinearModel
    #: experts are not split across ranks, nor MLA's or KDA's heads
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any) -> None:
        config.n_routed_experts = config.num_local_experts  # DeepSeek-V3's name, which GroupedMoeBlock reads
        super().__init__(config, ops)
        if self.lm_head.tied:  # transformers' Kimi Linear never ties its head
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.num_kv_heads = config.num_attention_heads  # the cache's heads: every head its own expanded K/V
        self.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        kinds = list(config.layer_types)  # transformers checks mlp_layer_types itself
        if len(kinds) != config.num_hidden_layers or set(kinds) - set(LAYER_TYPES):
            raise ValueError(f"KimiLinear: layer_types must name {config.num_hidden_layers} layers, each one "
                             f"of {', '.join(LAYER_TYPES)}; got {kinds}")
        if config.num_key_value_heads != config.num_attention_heads:
            raise NotImplementedError(f"KimiLinear: num_key_value_heads {config.num_key_value_heads} is not "
                                      "supported (MLA expands every one of the num_attention_heads "
                                      f"{config.num_attention_heads})")
        if not getattr(config, "mla_use_nope", True):
            raise NotImplementedError("KimiLinear: mla_use_nope false is not supported (transformers' MLA "
                                      "layers rotate nothing)")
        activation = getattr(config, "moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise NotImplementedError(f"KimiLinear: moe_router_activation_func {activation!r} is not "
                                      "supported (transformers' router scores by sigmoid)")
        cls.check_unread_fields(config)

    @classmethod
    def check_unread_fields(cls, config: Any) -> None:
        """Fields of Moonshot's configs that transformers' Kimi Linear does not read: refused when they ask
        for anything but what it does."""
        if (getattr(config, "moe_layer_freq", None) or 1) != 1:
            raise NotImplementedError(f"KimiLinear: moe_layer_freq {config.moe_layer_freq} is not supported "
                                      "(transformers puts experts on every layer from first_k_dense_replace "
                                      "on)")
        if getattr(config, "mla_use_output_gate", False):
            raise NotImplementedError("KimiLinear: mla_use_output_gate is not supported")
        linear = getattr(config, "linear_attn_config", None) or {}
        for field in ("gate_lower_bound", "use_full_rank_gate"):
            if linear.get(field):
                raise NotImplementedError(f"KimiLinear: linear_attn_config {field} {linear[field]!r} is not "
                                          "supported")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
