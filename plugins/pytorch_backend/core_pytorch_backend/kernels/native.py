"""The CPU op set: the reference ops, with a decode step's per-layer ops run by the native C kernels.

A decode step of a small model is mostly dispatch: the reference's decode attention is a gather of
every context block, a mask and SDPA (about 40 us a layer for one sequence on a 2-core EPYC), its
RMSNorm five ops, its rotary embedding seven. ``core_decode_attention``, ``core_rms_norm``,
``core_silu_and_mul``, ``core_rotary`` and ``core_store_kv`` (``native/csrc/cpu_ops.c``) do each in one
call over float32 or bfloat16 tensors (and KV caches of int8 rows: ``kv_int8``), and
``core_chunk_attention`` (``native/csrc/chunk_attention.c``) a step's prefill chunks. What they do not take (other dtypes, M-RoPE positions, bidirectional spans,
heads over 256 wide in a chunk) goes to the reference ops, which stay the oracle: the tests compare the
two.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from ..attention_metadata import AttentionMetadata
from ..native.library import CpuKernels, available
from ..native.packed_weight import DTYPE_CODES
from . import kv_int8, reference

NAME = "native"
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # csrc/cpu_ops.c
MAX_CHUNK_HEAD_DIM = 256  # csrc/chunk_attention.c
CACHE_CODES = {torch.float32: 0, torch.bfloat16: 1, kv_int8.DTYPE: 3}  # the KV caches the kernels take: csrc DT_*


def kernels() -> CpuKernels | None:
    """The native CPU kernels (None where they cannot be built)."""
    return available()


def _code(tensor: torch.Tensor) -> int | None:
    return DTYPE_CODES.get(tensor.dtype)


def _cache_code(cache: torch.Tensor) -> int | None:
    return CACHE_CODES.get(cache.dtype)


class _DecodeRows(NamedTuple):
    """A step's decode rows, shared by every layer (kept in ``meta.op_cache``)."""

    rows: torch.Tensor | None  # flat-batch rows of the decode sequences; None: every row, in order
    tables: torch.Tensor  # [R, width] int32
    lengths: torch.Tensor  # [R] int32


def _decode_rows(meta: AttentionMetadata) -> _DecodeRows | None:
    if "native_decode" in meta.op_cache:
        return meta.op_cache["native_decode"]
    decode, rows = reference.decode_rows(meta, meta.block_tables.device)
    plan = None
    if decode and not getattr(meta, "bidirectional_spans", None):
        tables, lengths = meta.block_tables, meta.seq_lens
        if rows is not None:
            index = torch.tensor(decode)
            tables, lengths = tables[index], lengths[index]
        plan = _DecodeRows(rows, tables.contiguous(), lengths.to(torch.int32).contiguous())
    meta.op_cache["native_decode"] = plan
    return plan


def _decode_fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    hq, d = query.shape[1:]
    hkv = k_cache.shape[2]
    return (query.device.type == "cpu" and _code(query) is not None and _cache_code(k_cache) is not None
            and d <= MAX_HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, sliding_window: int | None,
                     softcap: float | None = None) -> torch.Tensor:
    """[R, Hq, D] attention of one new token per row over its paged context (``core_decode_attention``; ``softcap``:
    its scores capped first, as Gemma 2's)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    rows, hq, d = query.shape
    kernels().call("core_decode_attention", query.data_ptr(), _code(query), rows, hq, d, k_cache.data_ptr(),
                   v_cache.data_ptr(), _cache_code(k_cache), k_cache.shape[1], k_cache.shape[2], tables.data_ptr(),
                   tables.shape[1], lengths.data_ptr(), sliding_window or 0, scale, softcap or 0.0, out.data_ptr())
    return out


class _ChunkRows(NamedTuple):
    """A step's prefill chunks (``meta.chunk_sequences``), shared by every layer."""

    count: int  # sequences
    query_start: torch.Tensor  # [S] int32: each chunk's first row in the flat batch
    query_len: torch.Tensor  # [S] int32
    seq_len: torch.Tensor  # [S] int32: cached tokens, the chunk's included
    tables: torch.Tensor  # [S, width] int32


def _chunk_rows(meta: AttentionMetadata) -> _ChunkRows | None:
    if "native_chunks" in meta.op_cache:
        return meta.op_cache["native_chunks"]
    starts = meta.row_starts()
    chunks = [(b, starts[b]) for b in meta.chunk_sequences()]
    plan = None
    if chunks:
        index = torch.tensor([b for b, _ in chunks])
        lens = torch.tensor([meta.query_lens_list[b] for b, _ in chunks], dtype=torch.int32)
        plan = _ChunkRows(len(chunks), torch.tensor([s for _, s in chunks], dtype=torch.int32), lens,
                          meta.seq_lens[index].to(torch.int32).contiguous(),
                          meta.block_tables[index].to(torch.int32).contiguous())
    meta.op_cache["native_chunks"] = plan
    return plan


def chunk_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _ChunkRows,
                    scale: float, sliding_window: int | None, out: torch.Tensor) -> None:
    """Fill the chunk rows of ``out`` [T, Hq, D] with their causal attention (``core_chunk_attention``)."""
    _, hq, d = query.shape
    kernels().call("core_chunk_attention", query.data_ptr(), _code(query), hq, d, k_cache.data_ptr(),
                   v_cache.data_ptr(), _cache_code(k_cache), k_cache.shape[1], k_cache.shape[2], plan.count,
                   plan.query_start.data_ptr(), plan.query_len.data_ptr(), plan.seq_len.data_ptr(),
                   plan.tables.data_ptr(), plan.tables.shape[1], sliding_window or 0, scale, out.data_ptr())


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """As ``reference.paged_attention``: decode rows and prefill chunks through the native kernels
    (bidirectional spans, other dtypes and larger heads through the reference; with ``softcap`` the chunks too,
    as ``core_chunk_attention`` does not cap scores)."""
    if not _decode_fits(query, k_cache, v_cache) or getattr(meta, "bidirectional_spans", None) \
            or query.shape[2] > MAX_CHUNK_HEAD_DIM:
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
    decode, chunks = _decode_rows(meta), _chunk_rows(meta)
    if decode is not None and decode.rows is None:
        return decode_attention(query, k_cache, v_cache, decode.tables, decode.lengths, scale, sliding_window,
                                softcap)
    query = query.contiguous()
    if chunks is not None and softcap:
        out = reference.paged_chunks(query, k_cache, v_cache, meta, scale, sliding_window,
                                     reference.ScoreTerms(softcap=softcap))
    else:
        out = torch.empty_like(query)
        if chunks is not None:
            chunk_attention(query, k_cache, v_cache, chunks, scale, sliding_window, out)
    if decode is not None:
        out[decode.rows] = decode_attention(query[decode.rows], k_cache, v_cache, decode.tables, decode.lengths,
                                            scale, sliding_window, softcap)
    return out


def softcapped_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, sliding_window: int | None, softcap: float) -> torch.Tensor:
    """``paged_attention`` of a layer whose only score term is Gemma 2's soft cap (``layers.attention``), its
    decode rows capped in ``core_decode_attention`` as the native decode stack caps them."""
    return paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As ``reference.rms_norm``, in one ``core_rms_norm`` call."""
    if (_code(x) is None or _code(weight) is None or x.device.type != "cpu"
            or (residual is not None and residual.dtype != x.dtype)):
        return reference.rms_norm(x, weight, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()  # named: a temporary would free its memory mid-call
    residual = None if residual is None else residual.contiguous()
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    kernels().call("core_rms_norm", x.data_ptr(), _code(x), x.numel() // hidden, hidden,
                   None if residual is None else residual.data_ptr(), weight.data_ptr(), _code(weight), eps,
                   out.data_ptr(), None if summed is None else summed.data_ptr())
    return out if residual is None else (out, summed)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None):
    """``layers.norm.LayerNorm``'s (x + residual, then torch's layer_norm) in one ``core_layer_norm`` call, computed in
    float32 and rounded once as torch's is: the decode stack calls the same kernel (StableLM's, Phi's norms...)."""
    if (_code(x) is None or _code(weight) is None or x.device.type != "cpu"
            or (bias is not None and bias.dtype != weight.dtype) or (residual is not None and residual.dtype != x.dtype)):
        return reference.layer_norm(x, weight, bias, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()  # named: a temporary would free its memory mid-call
    bias = None if bias is None else bias.contiguous()
    residual = None if residual is None else residual.contiguous()
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    kernels().call("core_layer_norm", x.data_ptr(), _code(x), x.numel() // hidden, hidden,
                   None if residual is None else residual.data_ptr(), weight.data_ptr(),
                   None if bias is None else bias.data_ptr(), _code(weight), eps, out.data_ptr(),
                   None if summed is None else summed.data_ptr())
    return out if residual is None else (out, summed)


ACT_SILU, ACT_GELU_TANH, ACT_RELU2, ACT_XIELU = 0, 1, 2, 3  # csrc/common.h


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As ``reference.silu_and_mul``, in one ``core_act_and_mul`` call."""
    if _code(x) is None or x.device.type != "cpu":
        return reference.silu_and_mul(x)
    return _act_and_mul(x, ACT_SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As ``reference.gelu_tanh_and_mul`` (Gemma's MLP) within a few float32 ulps, in one ``core_act_and_mul``
    call: the decode stack calls the same kernel, so that its hidden states are the modules' bit for bit."""
    if _code(x) is None or x.device.type != "cpu":
        return reference.gelu_tanh_and_mul(x)
    return _act_and_mul(x, ACT_GELU_TANH)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The ungated GELU-tanh (``layers.activation.Activation`` built with the op set: StarCoder 2's MLP) within a few
    float32 ulps of torch's, in one ``core_act`` call, which the decode stack makes too."""
    if _code(x) is None or x.device.type != "cpu":
        return torch.nn.functional.gelu(x, approximate="tanh")
    return _act(x, ACT_GELU_TANH)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """The ungated relu(x)^2 (Nemotron's, Arcee's and Jais 2's MLPs): torch's ``square(relu(x))`` bit for bit (one
    rounding of an exact square), in one ``core_act`` call, which the decode stack makes too."""
    if _code(x) is None or x.device.type != "cpu":
        return torch.square(torch.relu(x))
    return _act(x, ACT_RELU2)


def xielu(x: torch.Tensor, params: tuple[float, float, float, float]) -> torch.Tensor:
    """Apertus's xIELU of ``params`` (alpha_p, alpha_n, beta, eps: ``layers.activation.XIELU.params``) in one
    ``core_act`` call, which the decode stack makes too: each operation rounded to x's dtype as torch's are, the
    expm1 the C library's (within an ulp of torch's)."""
    if _code(x) is None or x.device.type != "cpu":
        alpha_p, alpha_n, beta, eps = params
        return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(x.clamp(max=eps)) - x) * alpha_n + beta * x)
    return _act(x, ACT_XIELU, params)


def _act(x: torch.Tensor, act: int, params: tuple[float, ...] | None = None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    floats = None if params is None else (ctypes.c_float * len(params))(*params)
    kernels().call("core_act", x.data_ptr(), _code(x), x.numel() // x.shape[-1], x.shape[-1], act,
                   None if floats is None else ctypes.addressof(floats), out.data_ptr())
    return out


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    x = x.contiguous()
    inner = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype)
    kernels().call("core_act_and_mul", x.data_ptr(), _code(x), x.numel() // (2 * inner), inner, act, out.data_ptr())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] float32 or bfloat16 logits (the first of equal values; a NaN
    above any number), in one ``core_argmax_rows`` call: torch's CPU argmax reads ~3 GB/s, 4% of a
    32-row decode step of SmolLM2 (csrc/argmax.c). Other shapes and dtypes take torch's."""
    if (logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.device.type != "cpu"
            or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    logits = logits.contiguous()  # named: a temporary would free its memory mid-call
    out = torch.empty(logits.shape[0], dtype=torch.long)
    kernels().call("core_argmax_rows", logits.data_ptr(), _code(logits), logits.shape[0], logits.shape[1],
                   out.data_ptr())
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` [T, H, D] with contiguous heads (a view into a fused projection's rows is fine) and the
    elements from one row to the next."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x, x.stride(0)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``reference.apply_rotary``, in one ``core_rotary`` call."""
    d = query.shape[-1]
    if (query.dtype != key.dtype or _code(query) is None or query.device.type != "cpu" or positions.dim() != 1
            or _code(cos_cache) is None or sin_cache.dtype != cos_cache.dtype or cos_cache.shape[1] * 2 != d
            or not (cos_cache.is_contiguous() and sin_cache.is_contiguous())):
        return reference.apply_rotary(query, key, positions, cos_cache, sin_cache)
    (query, q_stride), (key, k_stride) = _rows(query), _rows(key)
    positions = positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(query.shape, dtype=query.dtype), torch.empty(key.shape, dtype=key.dtype)
    kernels().call("core_rotary", query.data_ptr(), key.data_ptr(), _code(query), query.shape[0], query.shape[1],
                   key.shape[1], d, q_stride, k_stride, positions.data_ptr(), cos_cache.data_ptr(),
                   sin_cache.data_ptr(), _code(cos_cache), cos_cache.shape[0], q_out.data_ptr(), k_out.data_ptr())
    return q_out, k_out


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """As ``reference.store_kv_cache``, in one ``core_store_kv`` call."""
    if (key.dtype != value.dtype or _code(key) is None or _cache_code(k_cache) is None or key.device.type != "cpu"
            or v_cache.dtype != k_cache.dtype or slot_mapping.dtype != torch.int64
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return reference.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    (key, k_stride), (value, v_stride) = _rows(key), _rows(value)
    slots = slot_mapping.contiguous()
    kernels().call("core_store_kv", key.data_ptr(), value.data_ptr(), _code(key), key.shape[0], key.shape[1],
                   key.shape[2], k_stride, v_stride, slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   _cache_code(k_cache), k_cache.shape[0] * k_cache.shape[1])
