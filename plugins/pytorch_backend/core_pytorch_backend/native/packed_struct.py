"""A packed linear layer as the C kernels that compose others read it: ``core_packed`` (``csrc/common.h``), for the
native decode stack (``native_decode.py``) and the MoE expert mix (``native/expert_mix.py``)."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from ..layers.quantized import packed_linear
from .packed_weight import NativeWeight, scale_code

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class Packed(ctypes.Structure):  # csrc/common.h core_packed
    _fields_ = [("codes", _P), ("scale", _P), ("offset", _P), ("bias", _P), ("n", _L), ("kp", _L),
                ("bits", _I), ("group", _I), ("scale_dtype", _I)]


def packed_of(linear: nn.Module, keep: list[torch.Tensor]) -> Packed | None:
    """``linear``'s weight (and bias, as float32) as the C kernels read it, every tensor it points into appended to
    ``keep``; None where the weight is not a NativeWeight on the CPU that the packed kernel multiplies."""
    weight = linear.weight
    if not isinstance(weight, NativeWeight) or linear.matmul is not packed_linear:
        return None
    buffers = weight._buffers
    codes, scale, offset = buffers["codes"], buffers["scale"], buffers["offset"]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in (codes, scale, offset)):
        return None
    keep.extend((codes, scale, offset))
    bias = None
    if linear.bias is not None:
        keep.append(linear.bias.detach().to(torch.float32).contiguous())
        bias = keep[-1].data_ptr()
    return Packed(codes=codes.data_ptr(), scale=scale.data_ptr(), offset=offset.data_ptr(), bias=bias,
                  n=weight.shape[0], kp=weight.padded_k, bits=weight.bits, group=weight.group,
                  scale_dtype=scale_code(scale, weight.group))
