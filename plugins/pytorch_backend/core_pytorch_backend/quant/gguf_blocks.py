"""GGUF's block-quantized tensors as ``AffineWeight`` codes, without dequantizing them.

Each supported type is an affine map of unsigned codes per group of inputs (llama.cpp's ggml-quants.c
layouts; ``gguf.quants.dequantize`` is the oracle the tests compare against):

- Q4_0: 32 codes, fp16 ``d``: ``w = d * (q - 8)``
- Q4_1: 32 codes, fp16 ``d`` and ``m``: ``w = d * q + m``
- Q8_0: 32 signed bytes, fp16 ``d``: ``w = d * (q - 128)`` for the byte read unsigned (``q ^ 0x80``)
- Q4_K: 256 codes in 8 groups of 32, 6-bit group scales ``sc`` and mins ``mn`` under fp16 ``d`` / ``dmin``:
  ``w = d * sc * q - dmin * mn``
- Q5_0, Q5_1, Q5_K: Q4_0's, Q4_1's and Q4_K's maps with 5-bit codes (the fifth bits stored apart, in
  ``qh``): ``w = d * (q - 16)``, ``w = d * q + m``, ``w = d * sc * q - dmin * mn``; kept as 8-bit codes.
- IQ4_NL, IQ4_XS: 4-bit indices into 16 fixed non-uniform levels (int8 values), under fp16 ``d`` per
  32 inputs, or per 256 with a 6-bit scale per 32 (``d * (ls - 32)``): the level itself, shifted by 128,
  is an 8-bit code.
- MXFP4 (gpt-oss's experts): 32 4-bit indices into e2m1's levels, doubled to integers (ggml's
  ``kvalues_mxfp4``), under an e8m0 exponent ``e`` per block: ``w = 2^(e - 128) * level`` (ggml's
  ``e8m0_to_fp32_half``); the doubled level, shifted by 128, is an 8-bit code, as IQ4's.
- Q6_K, Q3_K, Q2_K: 256 codes of 6, 3 or 2 bits under a scale per 16 inputs (Q2_K also a min):
  ``w = d * sc * (q - 32)``, ``w = d * (sc - 32) * (q - 4)``, ``w = d * sc * q - dmin * mn``, in groups of
  16 (the native kernel folds each half of its 32-input groups with its own scale and offset).

Every one is exact: the codes, scales and offsets are the file's, and ``dequantize`` gives gguf's values
(codes of 2, 3, 5 and 6 bits take a byte each in the kernel's layout). Re-rounding the 16-input groups
to 8-bit codes per 32 inputs instead, as a first version did, cost agreement: a Q4_K_M file of the
default model, whose Q6_K tensors that touched, 99.10% against 99.65% exact.

``raw`` is a tensor's data as the gguf reader gives it: uint8 ``[rows, bytes per row]``. Other types
(F16, BF16, the other IQ types...) are not packed: the loader dequantizes them.
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


def _bit_pairs(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., 1, W] -> [..., 4, W]: row j holds bits 2j and 2j + 1 of each byte (the K-quants' 2-bit fields)."""
    return (packed >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 0x03


def _units(scale_unit: np.ndarray, offset_unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant's super-block values [rows, blocks, 1] as ``AffineWeight.units``: its scales and offsets are their
    small integer multiples (``d * sc``, ``-dmin * mn``, ``-32 * d * sc``...)."""
    return tuple(np.ascontiguousarray(u.reshape(u.shape[0], -1), dtype=np.float32) for u in (scale_unit, offset_unit))


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
    return AffineWeight(q, scale, offset, 4, QK, _units(d, -dmin))


def _fifth_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """``count`` bits of each little-endian bit field ``qh [..., count / 8]`` -> [..., count] values 0 / 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return (bits[..., :count] << 4).astype(np.uint8)


def _codes_5(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks' 16 code bytes and 4 fifth-bit bytes -> [..., 32] 5-bit codes."""
    return _nibbles(qs) | _fifth_bits(qh, 32)


def unpack_q5_0(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 22)
    d = _half(blocks[..., 0:2])
    q = _codes_5(blocks[..., 6:], blocks[..., 2:6]).reshape(rows, -1)
    return AffineWeight(q, d, -16 * d, 5, QK)


def unpack_q5_1(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 24)
    d, m = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    q = _codes_5(blocks[..., 8:], blocks[..., 4:8]).reshape(rows, -1)
    return AffineWeight(q, d, m, 5, QK)


def unpack_q5_k(raw: np.ndarray) -> AffineWeight:
    """Groups 2c and 2c+1 of a super-block take the low and high nibbles of its c-th 32 code bytes, and
    bits 2c and 2c+1 of its 32 ``qh`` bytes as their fifth bits (ggml's dequantize_row_q5_K)."""
    blocks, rows = _blocks(raw, 176)
    d, dmin = _half(blocks[..., 0:2])[..., None], _half(blocks[..., 2:4])[..., None]
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)
    low = np.concatenate((qs & 0x0F, qs >> 4), axis=3).reshape(rows, -1, 8, 32)  # group g = 2c + half
    fifth = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # [rows, blocks, 32 bytes, 8 bits]
    q = (low | (fifth.transpose(0, 1, 3, 2) << 4)).reshape(rows, -1)
    scale, offset = (d * sc).reshape(rows, -1), (-dmin * mn).reshape(rows, -1)
    return AffineWeight(q, scale, offset, 5, QK, _units(d, -dmin))


# IQ4's 16 levels (ggml's kvalues_iq4nl), shifted to unsigned 8-bit codes: w = scale * (code - 128)
IQ4_CODES = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128).astype(np.uint8)


def unpack_iq4_nl(raw: np.ndarray) -> AffineWeight:
    blocks, rows = _blocks(raw, 18)
    d = _half(blocks[..., 0:2])
    q = IQ4_CODES[_nibbles(blocks[..., 2:])].reshape(rows, -1)
    return AffineWeight(q, d, -128 * d, 8, QK)


def unpack_iq4_xs(raw: np.ndarray) -> AffineWeight:
    """8 groups of 32 a super-block, each under ``d * (ls - 32)`` with a 6-bit ``ls`` (4 low bits in
    ``scales_l``, 2 high in ``scales_h``; ggml's dequantize_row_iq4_xs)."""
    blocks, rows = _blocks(raw, 136)
    d = _half(blocks[..., 0:2])[..., None]
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [rows, blocks, 1]
    low = blocks[..., 4:8]
    group = np.arange(8)
    ls = ((low[..., group // 2] >> (4 * (group % 2))) & 0x0F) | (((high >> (2 * group)) & 0x03) << 4)
    scale = (d * (ls.astype(np.float32) - 32)).reshape(rows, -1)
    q = IQ4_CODES[_nibbles(blocks[..., 8:].reshape(rows, -1, 8, 16))].reshape(rows, -1)
    return AffineWeight(q, scale, -128 * scale, 8, QK, _units(d, -128 * d))


# MXFP4's 16 levels doubled (ggml's kvalues_mxfp4), shifted to unsigned 8-bit codes: w = scale * (code - 128)
MXFP4_CODES = (np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]) + 128).astype(np.uint8)


def unpack_mxfp4(raw: np.ndarray) -> AffineWeight:
    """A block's exponent byte ``e`` and 16 bytes of nibbles (low first, as Q4_0's); its scale
    ``2^(e - 128)`` as ggml's ``e8m0_to_fp32_half`` builds it, bit by bit (subnormal below e = 2)."""
    blocks, rows = _blocks(raw, 17)
    e = blocks[..., 0].astype(np.uint32)
    d = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
    q = MXFP4_CODES[_nibbles(blocks[..., 1:])].reshape(rows, -1)
    return AffineWeight(q, d, -128 * d, 8, QK)


def unpack_q6_k(raw: np.ndarray) -> AffineWeight:
    """6-bit codes under a scale per 16 inputs, ``w = d * sc * (q - 32)`` (ggml's dequantize_row_q6_K: a
    super-block's 128 bytes of low nibbles, 64 bytes of two high bits each, 16 signed 8-bit scales ``sc``
    and an fp16 ``d``; inputs 128n + 32m + l take nibble m // 2 of byte 64n + 32 (m % 2) + l and bits
    2m, 2m + 1 of high byte 32n + l)."""
    blocks, rows = _blocks(raw, 210)
    low_bytes = blocks[..., :128].reshape(rows, -1, 2, 2, 32)
    high_bytes = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.concatenate((low_bytes & 0x0F, low_bytes >> 4), axis=3)  # [.., n, m, l]
    q = (low | (_bit_pairs(high_bytes) << 4)).reshape(rows, -1)
    d = _half(blocks[..., 208:210])[..., None]
    scale = (d * blocks[..., 192:208].view(np.int8)).reshape(rows, -1)
    return AffineWeight(q, scale, -32 * scale, 6, QK_K // 16, _units(d, -32 * d))


def unpack_q2_k(raw: np.ndarray) -> AffineWeight:
    """2-bit codes under a 4-bit scale and min per 16 inputs (the low and high nibbles of 16 bytes), fp16
    ``d`` / ``dmin``: ``w = d * sc * q - dmin * mn`` (ggml's dequantize_row_q2_K: inputs 128n + 32j + l take
    bits 2j, 2j + 1 of code byte 32n + l)."""
    blocks, rows = _blocks(raw, 84)
    codes = blocks[..., 16:80].reshape(rows, -1, 2, 1, 32)
    q = _bit_pairs(codes).reshape(rows, -1)
    d, dmin = _half(blocks[..., 80:82])[..., None], _half(blocks[..., 82:84])[..., None]
    scales = blocks[..., :16]
    return AffineWeight(q, (d * (scales & 0x0F)).reshape(rows, -1), (-dmin * (scales >> 4)).reshape(rows, -1), 2,
                        QK_K // 16, _units(d, -dmin))


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 six-bit scales: 4 low bits from the nibbles of bytes 0-7, 2 high bits from bytes 8-11
    (ggml's kmask1 / kmask2 shuffle)."""
    low, high = packed[..., 0:8], packed[..., 8:12]
    nibbles = np.concatenate((low & 0x0F, low >> 4), axis=-1)  # scales 0-7, then 8-15
    tops = _bit_pairs(high[..., None, :])  # [.., 4 shifts, 4 bytes]
    return (nibbles | (tops.reshape(*high.shape[:-1], 16) << 4)).astype(np.float32)


def unpack_q3_k(raw: np.ndarray) -> AffineWeight:
    """3-bit codes under a signed 6-bit scale per 16 inputs and an fp16 ``d``: ``w = d * (sc - 32) * (q - 4)``
    (ggml's dequantize_row_q3_K: inputs 128n + 32j + l take bits 2j, 2j + 1 of code byte 32n + l and, as
    the third bit, bit 4n + j of mask byte l)."""
    blocks, rows = _blocks(raw, 110)
    codes = blocks[..., 32:96].reshape(rows, -1, 2, 1, 32)
    low = _bit_pairs(codes)  # [.., n, j, l]
    mask = blocks[..., None, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(2, 4)[..., None]  # bit 4n + j
    q = (low | ((mask & 0x01) << 2)).reshape(rows, -1)
    d = _half(blocks[..., 108:110])[..., None]
    scale = (d * (_q3_k_scales(blocks[..., 96:108]) - 32)).reshape(rows, -1)
    return AffineWeight(q, scale, -4 * scale, 3, QK_K // 16, _units(d, -4 * d))


UNPACKERS = {"Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q8_0": unpack_q8_0, "Q4_K": unpack_q4_k,
             "Q5_0": unpack_q5_0, "Q5_1": unpack_q5_1, "Q5_K": unpack_q5_k, "IQ4_NL": unpack_iq4_nl,
             "IQ4_XS": unpack_iq4_xs, "Q6_K": unpack_q6_k, "Q3_K": unpack_q3_k, "Q2_K": unpack_q2_k,
             "MXFP4": unpack_mxfp4}


def unpack(type_name: str, raw: np.ndarray) -> AffineWeight | None:
    """The codes of a tensor of GGUF type ``type_name``; None for types not kept packed."""
    unpacker = UNPACKERS.get(type_name)
    return unpacker(np.asarray(raw, dtype=np.uint8)) if unpacker else None
