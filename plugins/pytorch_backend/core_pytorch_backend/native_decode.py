"""A CPU decode step through every decoder layer in one native call (``native/csrc/decoder_stack.c``).

Eager PyTorch spends ~100 us a layer of a one-row decode step outside the kernels: module calls, the
ctypes calls of the dozen native ops, tensor allocations and views. For SmolLM2-135M on a 2-core EPYC that
was 2.9 of a 7.6 ms step. Here the layers' kernels are called from C in the order the modules call them,
on the same buffers, so the hidden states are bit for bit the module path's (tested); the embedding, the
final norm, the LM head and sampling stay in Python.

It is what CUDA graphs are on a GPU (cuda_graphs.py), with the same interface to the model runner:
``run(model, inputs)`` returns a decode step's hidden states or None (the step runs through the modules),
``release()`` drops every pointer into the weights and the KV cache (before they are freed), and the next
``run`` after a re-allocation describes the layers again.

It takes a model whose decoder is ``models.llama``'s (Llama, Qwen2, Qwen3, Mistral and the VL models over them,
and a subclass that runs its forward as it is), Granite's (what the attention and the MLP add to the residual
times its multiplier), OLMo 2's post-norm layers (and OLMo 3's and EXAONE 4's over them: only the attention's and
the MLP's outputs normalised; OLMo's q and k norms over all heads at once), GLM-4's (Llama's norms and those of
the attention's and the MLP's outputs), Arcee's (Llama's with an ungated relu^2 MLP), Apertus's (an ungated xIELU
MLP, the op set's ``xielu``, its parameters ``core_layer.act_params``), Ministral 3's (q times a factor of its
position after rotary, ``core_layer.q_scale``), NanoChat's (weightless RMSNorms, q and k normalized after rotary),
the LayerNorm decoders of StableLM, StarCoder 2, Phi, Command R / R7B, Jais 2 and Nemotron (LayerNorms,
Nemotron's of 1 + w, and ungated tanh GELUs or relu^2, which the native op set's ``layer_norm``, ``gelu_tanh`` and
``relu2`` run from the modules too; StableLM's, Cohere's and Phi's parallel layers) or one of Gemma's (``models.gemma``, ``gemma2``, ``vaultgemma``,
``gemma3``: float32 norms of 1 + w, GELU-tanh, Gemma 2 and 3's norms of the attention's and the MLP's outputs,
Gemma 2's soft-capped scores, which the native op set's ``softcapped_attention`` caps in the same C kernel, Gemma
3's rotary table per layer type), and the sparse MoE models over Llama's layer (Qwen2-MoE, Qwen3-MoE, Mixtral,
Granite MoE, OLMoE with its clip_qkv: an MoE layer's block is ``native/expert_mix.py``'s one call, router included,
which the modules' forward calls too): ``native_families.py``. It must be built on the native op set, with every
projection a ``NativeWeight`` (GGUF quants, ``--quantization int8|int4``), float32 or bfloat16 activations, a
float32, bfloat16 or int8 KV cache, and no hooks (tensor parallel ranks all-reduce in hooks). Steps with a prefill chunk, M-RoPE
positions or bidirectional image spans, and steps whose rows carry LoRA adapters (the runner routes those
elsewhere), run through the modules; so does everything with ``--enforce-eager``.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core_pytorch_backend.kernels.native import ACT_SILU, CACHE_CODES
from core_pytorch_backend.layers.attention import attention_layers
from core_pytorch_backend.layers.norm import WeightlessRMSNorm
from core_pytorch_backend.layers.rotary import RotaryEmbedding
from core_pytorch_backend.models.apertus import ApertusMLP
from core_pytorch_backend.models.gemma3 import GemmaRMSNorm
from core_pytorch_backend.models.phi import PhiAttention
from core_pytorch_backend.models.sparse_moe import SparseMoeBlock
from core_pytorch_backend.models.stablelm import StableLmAttention
from core_pytorch_backend.models.ungated_mlp import UngatedMLP
from core_pytorch_backend.native import tile_rows
from core_pytorch_backend.native.library import CpuKernels, available
from core_pytorch_backend.native.packed_struct import Packed, packed_of
from core_pytorch_backend.native.packed_weight import DTYPE_CODES, NativeWeight
from core_pytorch_backend.native_families import (
    NORM_KINDS,
    NORM_LAYER,
    Family,
    act_params_of,
    clip_qkv_of,
    family_of,
    mlp_parts,
    parallel_form,
    query_scales_of,
)
from core_pytorch_backend.step_inputs import StepInputs

log = logging.getLogger(__name__)
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # csrc/cpu_ops.c (decode attention)
GROUP_ROWS = 4  # csrc/decoder_stack.c's row-group path: units of at least 4 rows, in steps of 2 units a thread
# ... and of at least 32 where the VNNI loop has its exact int8 tiles (16 rows a tile, from 16 rows a call): a
# decode step of 64 rows on the AMX Xeon (family 6 model 167) 64-66 ms in units of 8 rows, 55-57 in units of
# 16, 52-57 in one call of 64 (benchmarks/decode_step.py, alone in the process); served, beside the event loop
# and the clients, two units of 32 beat the one call of 64 (row_group_from)
EXACT_TILES_GROUP_ROWS = 32
_STEP_DTYPES = (torch.float32, torch.bfloat16)
_DTYPE_OF = {code: dtype for dtype, code in DTYPE_CODES.items()}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Layer(ctypes.Structure):  # core_layer
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P),
                ("mlp_out_norm", _P), ("cos", _P), ("sin", _P), ("qkv", Packed), ("o", Packed), ("gate_up", Packed),
                ("down", Packed), ("k_cache", _P), ("v_cache", _P), ("window", _L), ("scale", _F), ("softcap", _F),
                ("rope", _I), ("moe", _P), ("input_bias", _P), ("post_bias", _P), ("q_scale", _P),
                ("act_params", _F * 4)]


class _Decoder(ctypes.Structure):  # core_decoder
    _fields_ = [("hidden", _L), ("heads", _L), ("kv_heads", _L), ("head_dim", _L), ("inter", _L),
                ("rotary_dim", _L),
                ("dtype", _I), ("cache_dtype", _I), ("table_dtype", _I), ("norm_kind", _I), ("act", _I),
                ("branch_scale", _F), ("qk_norm_whole", _I), ("qk_norm_after_rope", _I), ("eps", _F),
                ("clip_qkv", _F), ("parallel", _I),
                ("ungated", _I),
                ("block_size", _L), ("num_slots", _L), ("max_position", _L), ("tiles", _I),
                ("group_rows", _I), ("group_from", _I)]


class DoesNotFit(ValueError):
    """Why a model's decoder cannot take the native stack (said once in the start-up log)."""


@dataclass
class _Plan:
    """The described layers of one model, with the tensors they point into kept alive."""

    model: nn.Module
    attention: nn.Module  # the first attention layer, whose K cache is checked on every step
    cache_ptr: int  # its K cache when described: a new cache means describing again
    dtype: torch.dtype
    decoder: _Decoder
    layers: Any  # ctypes array of _Layer
    keep: list[Any]  # every tensor a pointer above reads (biases converted to float32 among them), MoE blocks' structs
    group_rows: int  # the row-group path's units as described (decoder.group_rows is 0 for a step whose rows
    # are not independent: AttentionMetadata.rows_independent)

    def matches(self, model: nn.Module) -> bool:
        cache = self.attention.k_cache
        return model is self.model and cache is not None and cache.data_ptr() == self.cache_ptr


class NativeDecodeStack:
    """Runs decode steps of one model through ``core_decoder_layers``; see the module docstring."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.function = kernels.function("core_decoder_layers")
        self.kernels = kernels
        self.plan: _Plan | None = None
        self.refused: tuple[nn.Module, int] | None = None  # (model, cache) found not to fit: not described again

    def run(self, model: nn.Module, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states [T, H] (after the final norm) of a decode step, or None when it takes the modules."""
        meta = inputs.meta
        if not meta.is_decode or inputs.positions.dim() != 1 or meta.bidirectional_spans:
            return None
        marked = tile_rows.current()  # the rows the packed weights multiply on the AMX tiles: all or none here
        if marked is not None and not marked.all_tiled:
            return None  # some rows on the tiles and others not: the modules' NativeWeight splits them
        if (self.plan is None or not self.plan.matches(model)) and not self.try_capture(model):
            return None
        plan, decoder = self.plan, model.model
        plan.decoder.tiles = marked is not None
        # rows of one sequence (a speculating chunk's verified positions) read each other's K/V: one call
        plan.decoder.group_rows = plan.group_rows if meta.rows_independent else 0
        hidden = decoder.embed_inputs(inputs.input_ids, inputs.embed_overrides)
        if hidden.dtype != plan.dtype:
            return None
        hidden = hidden.contiguous()  # a fresh tensor (an embedding lookup): the layers write into it
        residual = torch.empty_like(hidden)
        tables = meta.block_tables.contiguous()
        lengths = meta.seq_lens.to(torch.int32).contiguous()
        positions, slots = inputs.positions.contiguous(), meta.slot_mapping.contiguous()
        status = self.function(ctypes.addressof(plan.decoder), plan.layers, len(plan.layers), hidden.shape[0],
                               hidden.data_ptr(), residual.data_ptr(), 0, positions.data_ptr(), slots.data_ptr(),
                               tables.data_ptr(), tables.shape[1], lengths.data_ptr())
        if status:
            self.kernels.raise_for("core_decoder_layers", status)
        hidden, _ = decoder.norm(hidden, residual)
        return hidden

    def release(self) -> None:
        """Forget the described layers (the KV cache or the weights are about to be freed)."""
        self.plan = None

    def try_capture(self, model: nn.Module) -> bool:
        """Describe ``model``'s layers again (after a wakeup); False (logged once) if they do not fit."""
        self.plan = None
        if self.refused is not None and self.refused[0] is model and self.refused[1] == _cache_ptr(model):
            return False
        self.plan = described(model)
        if self.plan is None:
            self.refused = (model, _cache_ptr(model))
            return False
        return True


def make_native_decode(model: nn.Module, *, device: torch.device, enabled: bool) -> NativeDecodeStack | None:
    """The native decode stack for ``model`` (its KV cache bound), or None (the reason logged) where it
    does not apply: not on the CPU, disabled (``--enforce-eager``), no native kernels, or a decoder it
    does not take (see the module docstring)."""
    if not enabled or device.type != "cpu":
        return None
    kernels = available()
    if kernels is None:
        return None
    stack = NativeDecodeStack(kernels)
    stack.plan = described(model)
    if stack.plan is None:
        return None
    log.info("native decode stack: decode steps run all %d layers in one native call (%s kernels)",
             len(stack.plan.layers), kernels.variant)
    return stack


def described(model: nn.Module) -> _Plan | None:
    """``describe(model)``, or None with the reason logged: a decoder the stack does not take (DoesNotFit), or one
    whose describing failed otherwise (an architecture the family rules let through but whose layers hold
    something else: a warning with the traceback), whose decode steps then take the modules rather than the
    server failing to start."""
    try:
        return describe(model)
    except DoesNotFit as exc:
        log.info("native decode stack off: %s", exc)
    except Exception:  # noqa: BLE001 - any failure to describe leaves the modules, which serve every model
        log.warning("native decode stack off: describing %s's layers failed; decode steps take the modules",
                    type(model).__name__, exc_info=True)
    return None


def describe(model: nn.Module) -> _Plan:
    """Point the C structs at ``model``'s weights and KV caches; DoesNotFit says why they cannot be."""
    decoder = getattr(model, "model", None)
    family = family_of(decoder)
    if family is None:
        raise DoesNotFit(f"{type(model).__name__}'s decoder is not one the stack takes (native_families.FAMILIES)")
    if getattr(getattr(model, "ops", None), "name", None) != "native":
        raise DoesNotFit("the model is not built on the native op set")
    _no_hooks(model)
    layers = list(decoder.layers)
    if any(type(layer) is not family.layer or type(layer.self_attn) is not family.attention for layer in layers):
        raise DoesNotFit(f"{type(decoder).__name__}'s layers are not all {family.layer.__name__}s with "
                         f"{family.attention.__name__}")  # a subclass of a family's model with layers of its own
    first = layers[0]
    attention = first.self_attn
    dense = next((layer.mlp for layer in layers if type(layer.mlp) is family.mlp), None)  # None: every MLP an MoE
    rotary = _rotary_of(layers)
    width_norm = next(n for n in family.norms(first).values() if n is not None)  # one of the hidden width
    hidden, dtype = _width_and_dtype(width_norm, decoder, attention)
    cache = attention.attn.k_cache
    if cache is None:
        raise DoesNotFit("no KV cache is bound")
    if dtype not in _STEP_DTYPES or cache.dtype not in CACHE_CODES:
        raise DoesNotFit(f"{dtype} activations or a {cache.dtype} KV cache (float32 or bfloat16, or an int8 cache)")
    heads, kv_heads, head_dim = attention.attn.num_heads, attention.attn.num_kv_heads, attention.head_dim
    if head_dim > MAX_HEAD_DIM or heads // kv_heads > MAX_GROUP:
        raise DoesNotFit(f"{head_dim}-wide heads in groups of {heads // kv_heads}")
    act = ACT_SILU if dense is None else mlp_parts(dense)[2]
    if act is None:
        raise DoesNotFit("the MLP's activation (silu or GELU-tanh, an ungated one the op set's gelu_tanh, relu2 or "
                         "xielu)")
    qkv = attention.qkv_proj.weight
    if not isinstance(qkv, NativeWeight):
        raise DoesNotFit("layer 0's qkv_proj is not a native packed weight")
    # row groups would run each MoE block once a group, reading every chosen expert's weights once a group: one
    # call of all the rows, whose experts the threads share (csrc/moe_mix.c)
    moe = any(type(layer.mlp) is SparseMoeBlock for layer in layers)
    group_rows = 0 if moe else row_group_rows(qkv.kernels)
    keep: list[Any] = []
    spec = _Decoder(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    rotary_dim=rotary.rotary_dim, inter=1 if dense is None else mlp_parts(dense)[1].input_size,
                    dtype=DTYPE_CODES[dtype],
                    cache_dtype=CACHE_CODES[cache.dtype], table_dtype=DTYPE_CODES[rotary.cos_cache.dtype],
                    norm_kind=NORM_KINDS[family.norm], act=act, parallel=parallel_form(first, family),
                    ungated=int(family.mlp in (UngatedMLP, ApertusMLP)),
                    branch_scale=first.residual_multiplier if family.scaled else 1.0,
                    qk_norm_whole=int(family.qk_whole), qk_norm_after_rope=int(family.qk_after_rope),
                    eps=width_norm.eps, clip_qkv=clip_qkv_of(attention),
                    block_size=cache.shape[1], num_slots=cache.shape[0] * cache.shape[1],
                    max_position=rotary.cos_cache.shape[0], group_rows=group_rows,
                    group_from=row_group_from(group_rows))
    described = (_Layer * len(layers))()
    for index, layer in enumerate(layers):
        described[index] = _describe_layer(layer, index, family, spec, rotary, cache, keep)
    return _Plan(model, attention.attn, cache.data_ptr(), dtype, spec, described, keep, group_rows)


def _width_and_dtype(norm: nn.Module, decoder: nn.Module, attention: nn.Module) -> tuple[int, torch.dtype]:
    """The hidden width and the activations' dtype (a step whose embeddings differ takes the modules): a norm's
    weight's, or a weightless norm's (NanoChat's) the qkv projection's input width and the embeddings' dtype."""
    if isinstance(norm, WeightlessRMSNorm):
        return attention.qkv_proj.input_size, decoder.embed_tokens.weight.dtype
    return norm.weight.shape[0], norm.weight.dtype


def _rotary_of(layers: list[nn.Module]) -> RotaryEmbedding:
    """The first layer's rotary table, after checking that every layer's (Gemma 3: one per layer type; None: a
    layer without rotary) has its dtype, length and width (rotary_dim / 2: Phi-4-mini's partial rotary)."""
    tables = [layer.self_attn.rotary_emb for layer in layers if layer.self_attn.rotary_emb is not None]
    if not tables:
        raise DoesNotFit("no layer has a rotary embedding")
    first = tables[0]
    for rotary in tables:
        if not isinstance(rotary, RotaryEmbedding) or rotary.cos_cache.dtype not in _STEP_DTYPES:
            raise DoesNotFit("an unsupported rotary embedding")
        if rotary.cos_cache.dtype != first.cos_cache.dtype or rotary.cos_cache.shape != first.cos_cache.shape:
            raise DoesNotFit("rotary tables of different lengths or dtypes")
    return first


def row_group_rows(kernels: CpuKernels) -> int:
    """The fewest rows of a unit of the row-group path with these kernels."""
    return max(GROUP_ROWS, EXACT_TILES_GROUP_ROWS) if kernels.exact_tiles() else GROUP_ROWS


def row_group_from(group_rows: int) -> int:
    """The fewest rows a step must have to take the row-group path: a unit a thread, of at least two of
    GROUP_ROWS (16 on 2 cores with units of 4: a step of 8 rows keeps the kernels' own splits, which read each
    weight once). With the exact tiles' units of 32, 64 on 2 cores: a step of 64 rows in two units, each
    thread its own, served 5.6% more output tokens/s at 64 streams than in one call of 64 (whose kernels
    meet at ~300 barriers a step, where a thread the server's event loop or a client takes away holds the
    other up; `side_by_side.py --peers core --concurrency 32 64`, six alternations on the AMX Xeon)."""
    return max(2 * GROUP_ROWS, group_rows) * torch.get_num_threads()


def _describe_layer(layer: nn.Module, index: int, family: Family, spec: _Decoder, first_rotary: RotaryEmbedding,
                    cache: torch.Tensor, keep: list[Any]) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    moe = _moe_block(mlp, index, spec, keep) if type(mlp) is SparseMoeBlock else None
    if (type(layer) is not family.layer or type(attention) is not family.attention
            or (moe is None and (type(mlp) is not family.mlp or mlp_parts(mlp)[2] != spec.act))):
        raise DoesNotFit(f"layer {index} is not its family's decoder layer with the dense layers' activation")
    up, down = (None, None) if moe else mlp_parts(mlp)[:2]
    if moe is None and down.input_size != spec.inter:
        raise DoesNotFit(f"layer {index}'s MLP is not as wide as the other dense layers'")
    if family.scaled and _F(layer.residual_multiplier).value != spec.branch_scale:
        raise DoesNotFit(f"layer {index}'s residual_multiplier differs from layer 0's")
    attn = attention.attn
    if (attn.has_score_terms and not attn.only_softcapped) or attn.v_head_dim != attn.head_dim:
        raise DoesNotFit(f"layer {index}'s attention adds score terms (but a soft cap) or has narrower values")
    if _F(clip_qkv_of(attention)).value != spec.clip_qkv or parallel_form(layer, family) != spec.parallel:
        raise DoesNotFit(f"layer {index}'s clip_qkv or residual form differs from layer 0's")
    if type(attention) in (StableLmAttention, PhiAttention) and attention.q_layernorm is not None:
        raise DoesNotFit(f"layer {index} has LayerNorms of the heads of q and k (qk_layernorm)")
    if (attn.k_cache is None or attn.v_cache is None or attn.k_cache.dtype != cache.dtype
            or attn.k_cache.shape != cache.shape or not (attn.k_cache.is_contiguous() and attn.v_cache.is_contiguous())
            or attn.v_cache.dtype != cache.dtype or attn.num_heads != spec.heads or attn.num_kv_heads != spec.kv_heads):
        raise DoesNotFit(f"layer {index}'s KV cache or heads differ from layer 0's")
    norms = family.norms(layer)
    head = spec.head_dim  # the widths of a weightless norm's ones
    widths = {"q": spec.heads * head, "k": spec.kv_heads * head} if family.qk_whole else {"q": head, "k": head}
    weights = {name: _norm_weight(norm, family, spec, index, keep, widths.get(name, spec.hidden))
               for name, norm in norms.items()}
    rotary = attention.rotary_emb or first_rotary  # a layer without rotary (rope 0) never reads the table
    q_scales = query_scales_of(attention)
    if q_scales is not None and q_scales.shape[0] != spec.max_position:
        raise DoesNotFit(f"layer {index}'s query scales are not as long as the rotary table")
    return _Layer(input_norm=weights["input"], post_norm=weights["before_mlp"], q_norm=weights["q"],
                  k_norm=weights["k"], attn_out_norm=weights["attn_out"], mlp_out_norm=weights["mlp_out"],
                  cos=_ptr(rotary.cos_cache, keep), sin=_ptr(rotary.sin_cache, keep),
                  qkv=_packed(attention.qkv_proj, index, keep), o=_packed(getattr(attention, family.o_proj), index, keep),
                  gate_up=Packed() if moe else _packed(up, index, keep),
                  down=Packed() if moe else _packed(down, index, keep),
                  k_cache=_ptr(attn.k_cache, keep), v_cache=_ptr(attn.v_cache, keep), window=attn.sliding_window or 0,
                  scale=attn.scale, softcap=attn.softcap or 0.0, rope=int(attention.rotary_emb is not None), moe=moe,
                  input_bias=_norm_bias(norms["input"], family, keep),
                  post_bias=_norm_bias(norms["before_mlp"], family, keep),
                  q_scale=None if q_scales is None else _ptr(q_scales.to(_DTYPE_OF[spec.dtype]).contiguous(), keep),
                  act_params=(_F * 4)(*(act_params_of(mlp) if moe is None else (0.0,) * 4)))


def _moe_block(block: SparseMoeBlock, index: int, spec: _Decoder, keep: list[Any]) -> int:
    """The pointer the C layer reads for a sparse MoE block: its core_moe (native/expert_mix.py), kept alive."""
    kernel = block.native_kernel(torch.device("cpu"))
    if kernel is None or kernel.moe is None or DTYPE_CODES[kernel.router_dtype] != spec.dtype:
        unpacked = next((f"its {name} of {linear.weight.shape[1]} inputs is not a packed weight"
                         for name, linear in block.named_modules()
                         if name.endswith(("gate_up_proj", "down_proj")) and packed_of(linear, []) is None),
                        "packed experts, a float router of the activations' dtype")
        raise DoesNotFit(f"layer {index}'s MoE block is not one native call ({unpacked})")
    keep.append(kernel)
    return ctypes.addressof(kernel.moe)


def _norm_weight(norm: nn.Module | None, family: Family, spec: _Decoder, index: int, keep: list[torch.Tensor],
                 width: int) -> int | None:
    """The pointer the C layer reads for ``norm`` (None: no such norm): an RMSNorm's or a LayerNorm's weight as it
    is (a LayerNorm's scale(): LayerNorm1P's 1 + weight); a GemmaRMSNorm's 1 + weight in float32, computed as its
    forward computes it on every call; a WeightlessRMSNorm's float32 ones of ``width``."""
    if norm is None:
        return None
    if type(norm) is not family.norm or _F(norm.eps).value != spec.eps:
        raise DoesNotFit(f"layer {index}'s norms differ (type or eps)")
    layer_norm = NORM_KINDS[family.norm] == NORM_LAYER
    if layer_norm and getattr(norm.ops, "layer_norm", None) is None:
        raise DoesNotFit(f"layer {index}'s LayerNorms are torch's, not the op set's (core_layer_norm)")
    if layer_norm and norm.bias is not None and norm.bias.dtype != norm.weight.dtype:
        raise DoesNotFit(f"layer {index}'s LayerNorm bias is not of its weight's dtype")
    if family.norm is GemmaRMSNorm:
        return _ptr((1.0 + norm.weight.float()).contiguous(), keep)
    if family.norm is WeightlessRMSNorm:  # the float32 ones its forward multiplies by (NORM_RMS_FLOAT)
        if norm.rms_ops is None:
            raise DoesNotFit(f"layer {index}'s weightless norms are torch's, not the op set's rms_norm")
        return _ptr(torch.ones(width, dtype=torch.float32), keep)
    weight = norm.scale() if layer_norm else norm.weight  # Nemotron's LayerNorm1P: its 1 + w, as its forward's
    if DTYPE_CODES.get(weight.dtype) != spec.dtype:
        raise DoesNotFit(f"layer {index}'s norm weights are not of the activations' dtype")
    return _ptr(weight.contiguous(), keep)


def _norm_bias(norm: nn.Module | None, family: Family, keep: list[torch.Tensor]) -> int | None:
    """A LayerNorm's bias (None: none, or not a LayerNorm)."""
    layer_norm = norm is not None and NORM_KINDS[family.norm] == NORM_LAYER
    return _ptr(norm.bias, keep) if layer_norm and norm.bias is not None else None


def _packed(linear: nn.Module, index: int, keep: list[torch.Tensor]) -> Packed:
    packed = packed_of(linear, keep)
    if packed is None:
        raise DoesNotFit(f"layer {index}'s {type(linear).__name__} is not a native packed weight")
    return packed


def _ptr(tensor: torch.Tensor, keep: list[torch.Tensor]) -> int:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise DoesNotFit("a weight or cache is not a contiguous CPU tensor")
    keep.append(tensor)
    return tensor.data_ptr()


def _no_hooks(model: nn.Module) -> None:
    """The stack bypasses the model's and its layers' forward: none may carry a hook (tensor-parallel
    all-reduces are hooks), so none anywhere in the model is allowed."""
    for name, sub in model.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            raise DoesNotFit(f"{name or 'the model'} has forward hooks (tensor parallelism?)")


def _cache_ptr(model: nn.Module) -> int:
    """The first attention layer's K cache (0: none bound, or no attention layer)."""
    layers = attention_layers(model)
    return layers[0].k_cache.data_ptr() if layers and layers[0].k_cache is not None else 0
