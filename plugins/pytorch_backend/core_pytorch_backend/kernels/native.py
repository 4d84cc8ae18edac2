"""The CPU op set: the reference ops, with a decode step's per-layer ops run by the native C kernels.

A decode step of a small model is mostly dispatch: the reference's decode attention is a gather of
every context block, a mask and SDPA (about 40 us a layer for one sequence on a 2-core EPYC), its
RMSNorm five ops. ``core_decode_attention``, ``core_rms_norm`` and ``core_silu_and_mul``
(``native/csrc/cpu_ops.c``) do each in one call over contiguous float32 or bfloat16 tensors. What they
do not take (prefill chunks, other dtypes, bidirectional spans) goes to the reference ops, which stay
the oracle: the tests compare the two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..attention_metadata import AttentionMetadata
from ..native.library import CpuKernels, available
from ..native.packed_weight import DTYPE_CODES
from . import reference

NAME = "native"
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # csrc/cpu_ops.c
store_kv_cache = reference.store_kv_cache
apply_rotary = reference.apply_rotary
gelu_tanh_and_mul = reference.gelu_tanh_and_mul


def kernels() -> CpuKernels | None:
    """The native CPU kernels (None where they cannot be built)."""
    return available()


def _code(tensor: torch.Tensor) -> int | None:
    return DTYPE_CODES.get(tensor.dtype)


class _DecodeRows(NamedTuple):
    """A step's decode rows, shared by every layer (kept in ``meta.op_cache``)."""

    rows: torch.Tensor | None  # flat-batch rows of the decode sequences; None: every row, in order
    tables: torch.Tensor  # [R, width] int32
    lengths: torch.Tensor  # [R] int32


def _decode_rows(meta: AttentionMetadata) -> _DecodeRows | None:
    if "native_decode" in meta.op_cache:
        return meta.op_cache["native_decode"]
    decode = [b for b, q in enumerate(meta.query_lens_list) if q == 1]
    plan = None
    if decode and not getattr(meta, "bidirectional_spans", None):
        if len(decode) == len(meta.query_lens_list):
            plan = _DecodeRows(None, meta.block_tables.contiguous(), meta.seq_lens.to(torch.int32).contiguous())
        else:
            starts = [0]
            for q_len in meta.query_lens_list:
                starts.append(starts[-1] + q_len)
            index = torch.tensor(decode)
            plan = _DecodeRows(torch.tensor([starts[b] for b in decode]), meta.block_tables[index].contiguous(),
                               meta.seq_lens[index].to(torch.int32).contiguous())
    meta.op_cache["native_decode"] = plan
    return plan


def _decode_fits(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    hq, d = query.shape[1:]
    hkv = k_cache.shape[2]
    return (query.device.type == "cpu" and _code(query) is not None and _code(k_cache) is not None
            and d <= MAX_HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP and k_cache.is_contiguous())


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """[R, Hq, D] attention of one new token per row over its paged context (``core_decode_attention``)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    rows, hq, d = query.shape
    kernels().call("core_decode_attention", query.data_ptr(), _code(query), rows, hq, d, k_cache.data_ptr(),
                   v_cache.data_ptr(), _code(k_cache), k_cache.shape[1], k_cache.shape[2], tables.data_ptr(),
                   tables.shape[1], lengths.data_ptr(), sliding_window or 0, scale, out.data_ptr())
    return out


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """As ``reference.paged_attention``; decode rows through the native kernel."""
    plan = _decode_rows(meta) if _decode_fits(query, k_cache) else None
    if plan is None:
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    if plan.rows is None:
        return decode_attention(query, k_cache, v_cache, plan.tables, plan.lengths, scale, sliding_window)
    out = reference.paged_chunks(query, k_cache, v_cache, meta, scale, sliding_window)
    out[plan.rows] = decode_attention(query[plan.rows], k_cache, v_cache, plan.tables, plan.lengths, scale,
                                      sliding_window)
    return out


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As ``reference.silu_and_mul``, in one ``core_silu_and_mul`` call."""
    if _code(x) is None or x.device.type != "cpu":
        return reference.silu_and_mul(x)
    x = x.contiguous()
    inner = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype)
    kernels().call("core_silu_and_mul", x.data_ptr(), _code(x), x.numel() // (2 * inner), inner, out.data_ptr())
    return out
