"""MXFP4 (OCP microscaling FP4, OpenAI's gpt-oss checkpoints): ``*_blocks`` uint8, two FP4 (e2m1) codes a
byte, the low nibble first, and ``*_scales`` uint8, one power of two 2^(scale - 127) (e8m0) per 32 values;
read as float32 as transformers' ``Mxfp4Config(dequantize=True)`` reads them, bit for bit."""

from __future__ import annotations

import torch

# the e2m1 value of each 4-bit code (sign bit, 2 exponent bits, 1 mantissa bit), as transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# each byte's two values (low nibble's, high nibble's) as one 8-byte item: a gather of one item a byte
_FP4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
_BYTE_VALUES = torch.stack((_FP4.repeat(16), _FP4.repeat_interleave(16)), dim=-1).view(torch.int64).flatten()

def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., groups * 32] of MXFP4 ``blocks`` [..., groups, 16] (two codes a byte, the low nibble the
    even value) and ``scales`` [..., groups] (e8m0: 2^(scale - 127) for the group's 32 values; 255, e8m0's NaN,
    is no scale a checkpoint holds)."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "([..., groups, 16] and [..., groups])")
    values = _BYTE_VALUES.index_select(0, blocks.flatten().int()).view(torch.float32).view(*scales.shape, 32)
    return (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)
