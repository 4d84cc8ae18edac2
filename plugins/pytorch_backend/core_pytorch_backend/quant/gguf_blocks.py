"""GGUF's block-quantized tensors as ``AffineWeight`` codes, without dequantizing them.

Each supported type is an affine map of unsigned codes per group of inputs (llama.cpp's ggml-quants.c
layouts; ``gguf.quants.dequantize`` is the oracle the tests compare against):

- Q4_0: 32 codes, fp16 ``d``: ``w = d * (q - 8)``
- Q4_1: 32 codes, fp16 ``d`` and ``m``: ``w = d * q + m``
- Q8_0: 32 signed bytes, fp16 ``d``: ``w = d * (q - 128)`` for the byte read unsigned (``q ^ 0x80``)
- Q4_K: 256 codes in 8 groups of 32, 6-bit group scales ``sc`` and mins ``mn`` under fp16 ``d`` / ``dmin``:
  ``w = d * sc * q - dmin * mn``

``raw`` is a tensor's data as the gguf reader gives it: uint8 ``[rows, bytes per row]``. Other types
(Q6_K's 16-wide groups among them) are not packed: the loader dequantizes them.
"""

from __future__ import annotations

import numpy as np

from .affine import AffineWeight

QK = 32
QK_K = 256


def _blocks(raw: np.ndarray, block_bytes: int) -> tuple[np.ndarray, int]:
    rows = raw.shape[0]
    if raw.shape[1] % block_bytes:
        raise ValueError(f"row of {raw.shape[1]} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(rows, -1, block_bytes), rows


def _half(b: np.ndarray) -> np.ndarray:
    """fp16 stored as two bytes at the end axis -> float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles first, then high nibbles (ggml's order)."""
    out = np.empty((*qs.shape[:-1], 2 * qs.shape[-1]), dtype=np.uint8)
    half = qs.shape[-1]
    np.bitwise_and(qs, 0x0F, out=out[..., :half])
    np.right_shift(qs, 4, out=out[..., half:])
    return out


def unpack_q4_0(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 18)
    d = _half(blocks[..., 0:2])
    q = _nibbles(blocks[..., 2:]).reshape(rows, -1)
    return AffineWeight(q, d, -8 * d, 4, QK)


def unpack_q4_1(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 20)
    d, m = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    q = _nibbles(blocks[..., 4:]).reshape(rows, -1)
    return AffineWeight(q, d, m, 4, QK)


def unpack_q8_0(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 34)
    d = _half(blocks[..., 0:2])
    q = (blocks[..., 2:] ^ 0x80).reshape(rows, -1)  # signed byte s -> s + 128
    return AffineWeight(q, d, -128 * d, 8, QK)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    low = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return scale.astype(np.float32), low.astype(np.float32)


def unpack_q4_k(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 144)
    d, dmin = _half(blocks[..., 0:2])[..., None], _half(blocks[..., 2:4])[..., None]
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: 64 codes each
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(rows, -1)
    scale, offset = (d * sc).reshape(rows, -1), (-dmin * mn).reshape(rows, -1)
    return AffineWeight(q, scale, offset, 4, QK)


UNPACKERS = {"Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q8_0": unpack_q8_0, "Q4_K": unpack_q4_k}


def unpack(type_name: str, raw: np.ndarray) -> AffineWeight | None:
    """The codes of a tensor of GGUF type ``type_name``; None for types not kept packed."""
    unpacker = UNPACKERS.get(type_name)
    return unpacker(np.asarray(raw, dtype=np.uint8)) if unpacker else None
