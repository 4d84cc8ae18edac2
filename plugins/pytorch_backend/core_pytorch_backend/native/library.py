"""The compiled CPU kernels as a Python object: ctypes signatures, status checks, one load per process.

ctypes and a C ABI, as the CUDA plugin does: building needs only a C compiler (no torch headers, no
matching C++ ABI) and one library serves every torch version. A call costs a few microseconds of ctypes
overhead; the kernels take raw pointers (``tensor.data_ptr()``) of contiguous CPU tensors.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from .build import CpuBuildError, build_library, chosen_variant

log = logging.getLogger(__name__)
ABI_VERSION = 23  # csrc/packed_linear.c CORE_PACKED_ABI
STATUS = {1: "bad arguments", 2: "out of memory", 3: "no prompt loop (a build without AVX512-BF16)"}

# csrc/packed_linear.c core_packed_prompt_loop: the packed matmuls' loop for prompt tokens' rows
PROMPT_LOOPS = {0: None, 1: "vectors", 2: "amx"}

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, list] = {
    # x, x dtype, M, K, codes, bits (4, 8, or 16: 16-bit float weights, half_linear.c), group (inputs a scale covers:
    # 32, or 16 for 8-bit codes), N, Kp, scale, offset (NULL for bits 16), their dtype (bits 16:
    # the weight's), bias, y, y dtype
    "core_packed_linear": [_P, _I, _L, _L, _P, _I, _I, _L, _L, _P, _P, _I, _P, _P, _I],
    "core_packed_linear_reference": [_P, _I, _L, _L, _P, _I, _I, _L, _L, _P, _P, _I, _P, _P, _I],
    "core_packed_linear_tiles": [_P, _I, _L, _L, _P, _I, _I, _L, _L, _P, _P, _I, _P, _P, _I],
    # the same arguments; y [M, N / 2]: silu(gate) * up of a merged [gate | up] weight's product
    "core_packed_linear_tiles_silu": [_P, _I, _L, _L, _P, _I, _I, _L, _L, _P, _P, _I, _P, _P, _I],
    # q, q dtype, rows, Hq, D, k cache, v cache, cache dtype (kernels/native.py CACHE_CODES: 3 an int8 cache's
    # rows, kernels/kv_int8.py), block size, Hkv, tables, table width, lengths, window, scale, softcap (0: none), out
    "core_decode_attention": [_P, _I, _L, _L, _L, _P, _P, _I, _L, _L, _P, _L, _P, _L, _F, _F, _P],
    # x, dtype, T, H, residual, weight, weight dtype, eps, out, residual out
    "core_rms_norm": [_P, _I, _L, _L, _P, _P, _I, _F, _P, _P],
    # x, dtype, T, H, residual, weight (float32), eps, out, residual out: Gemma's norm (weights 1 + w, in float32)
    "core_rms_norm_float": [_P, _I, _L, _L, _P, _P, _F, _P, _P],
    # x, dtype, T, H, residual, weight, bias (or NULL), their dtype, eps, out, residual out: LayerNorm
    "core_layer_norm": [_P, _I, _L, _L, _P, _P, _P, _I, _F, _P, _P],
    # x, dtype, T, I, out
    "core_silu_and_mul": [_P, _I, _L, _L, _P],
    # x, dtype, T, I, activation (0 silu, 1 GELU-tanh: csrc/common.h ACT_*), out
    "core_act_and_mul": [_P, _I, _L, _L, _I, _P],
    # the same arguments, x [T, I]: the ungated activation (out may be x)
    "core_act": [_P, _I, _L, _L, _I, _P, _P],
    # q, k, dtype, T, Hq, Hkv, D, q row stride, k row stride, positions, cos, sin, their dtype,
    # max position, q out, k out
    "core_rotary": [_P, _P, _I, _L, _L, _L, _L, _L, _L, _P, _P, _P, _I, _L, _P, _P],
    # k, v, dtype, T, Hkv, D, k row stride, v row stride, slots, k cache, v cache, cache dtype, slots in cache
    "core_store_kv": [_P, _P, _I, _L, _L, _L, _L, _L, _P, _P, _P, _I, _L],
    # x, rows, in, y, out, row slots, slots, slot ranks, max rank, shards, shard starts, shard sizes, a, bt,
    # their dtype (csrc/lora.c)
    "core_lora_apply": [_P, _L, _L, _P, _L, _P, _L, _P, _L, _L, _P, _P, _P, _P, _I],
    "core_lora_max_rank": [],
    # q, q dtype, Hq, D, k cache, v cache, cache dtype, block size, Hkv, sequences, query starts, query
    # lengths, sequence lengths, tables, table width, window, scale, out (csrc/chunk_attention.c)
    "core_chunk_attention": [_P, _I, _L, _L, _P, _P, _I, _L, _L, _L, _P, _P, _P, _P, _L, _L, _F, _P],
    # decoder, layers, layer count, rows, hidden, residual, residual given, positions, slots, tables,
    # table width, lengths (csrc/decoder_stack.c)
    "core_decoder_layers": [_P, _P, _L, _L, _P, _P, _I, _P, _P, _P, _L, _P],
    # x, dtype, T, H, top k, chosen int64 [T, k], weights [T, k] (x's dtype), tiled uint8 [T] (or NULL), experts,
    # gate_up core_packed [experts], down core_packed [experts], inter, out [T, H] (csrc/moe_mix.c)
    "core_moe_mix": [_P, _I, _L, _L, _L, _P, _P, _P, _L, _P, _P, _L, _P],
    # core_moe (csrc/common.h), x, dtype, T, H, tiled uint8 [T] (or NULL), all tiled, out [T, H] (csrc/moe_mix.c)
    "core_moe_block": [_P, _P, _I, _L, _L, _P, _I, _P],
    # core_moe, x, dtype, T, H, weights [T, k] (x's dtype), chosen int64 [T, k]
    "core_moe_route": [_P, _P, _I, _L, _L, _P, _P],
    # logits, dtype, rows, vocabulary, out int64 [rows] (csrc/argmax.c)
    "core_argmax_rows": [_P, _I, _L, _L, _P],
    # q, k, v, g, beta, state, (sequence, head) pairs, Dk, Dv, out: float32 (csrc/delta_rule.c)
    "core_delta_rule_step": [_P, _P, _P, _P, _P, _P, _L, _L, _L, _P],
    # x, dt, A, B, C, state, sequences, heads, groups, head dim, state size, y: float32 (csrc/ssd_step.c)
    "core_ssd_step": [_P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _P],
}


class CpuKernelError(RuntimeError):
    """A kernel refused its arguments; the message names the kernel and the cause."""


class CpuKernels:
    """The loaded library of one variant; ``call(name, *args)`` runs a kernel and raises on a non-zero
    status (arguments in ``SIGNATURES`` order)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.core_packed_abi_version.restype = ctypes.c_int
        self._lib.core_packed_variant.restype = ctypes.c_char_p
        version = self._lib.core_packed_abi_version()
        if version != ABI_VERSION:
            raise CpuKernelError(f"{self.path} has C ABI version {version}, expected {ABI_VERSION}; rebuild it")
        self.variant = self._lib.core_packed_variant().decode()
        self._lib.core_packed_uses_amx.restype = ctypes.c_int
        # whether the AMX tiles are granted (the prompt loop on them, the VNNI loop's exact int8 tiles)
        self.uses_amx = bool(self._lib.core_packed_uses_amx())
        # the loop core_packed_linear_tiles runs, None where it refuses (native/tile_rows.py: which rows take it)
        self.prompt_loop = PROMPT_LOOPS[self._lib.core_packed_prompt_loop()]
        self._functions = {}
        for name, argtypes in SIGNATURES.items():
            function = getattr(self._lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            self._functions[name] = function

    def exact_tiles(self, allow: bool | None = None) -> bool:
        """Whether the VNNI loop's calls of 16 rows or more take its exact int8 tile loop (AMX-INT8, the same
        bits: csrc/packed_linear.c ``exact_tile_outputs``); ``allow`` turns it off or on, for benchmarks and
        tests that compare the two."""
        return bool(self._lib.core_packed_exact_tiles(-1 if allow is None else int(allow)))

    def acts_base(self, bits: int) -> int:
        """The packed matmuls' activations' second step for a weight of ``bits``-bit codes: x ~ (d / base)
        (base q1 + q2), 127, or 16 for 4-bit codes on a build with exact int8 tiles (csrc/packed_linear.c
        ``ACTS_BASE``)."""
        return int(self._lib.core_packed_acts_base(bits))

    def tile_twin(self, allow: bool | None = None) -> bool:
        """Whether the tile loop's calls of one or two rows take its vector twin (the tiles' bits on AVX-512
        vectors: csrc/packed_linear.c ``packed_linear_twin``); ``allow`` turns it off or on, for benchmarks and
        tests that compare the two."""
        return bool(self._lib.core_packed_tile_twin(-1 if allow is None else int(allow)))

    def call(self, name: str, *args) -> None:
        """Run kernel ``name``; raises CpuKernelError naming it on a non-zero status."""
        status = self._functions[name](*args)
        if status:
            self.raise_for(name, status)

    def function(self, name: str):
        """Kernel ``name``'s ctypes function, for a caller on a hot path that checks the status it returns
        itself (``raise_for``)."""
        return self._functions[name]

    @staticmethod
    def raise_for(name: str, status: int) -> None:
        raise CpuKernelError(f"{name}: {STATUS.get(status, f'status {status}')}")


@functools.cache
def load(variant: str | None = None) -> CpuKernels:
    """The kernels of ``variant`` (default: ``build.chosen_variant()``), built on first use."""
    return CpuKernels(build_library(variant or chosen_variant()[0]))


@functools.cache
def available() -> CpuKernels | None:
    """This CPU's kernels, or None (logged once) where no compiler is found or the build fails.

    A ``CORE_CPU_KERNELS`` this CPU cannot run raises InvalidRequestError (a setting to mend, not to serve around)."""
    variant, why = chosen_variant()
    try:
        kernels = load(variant)
    except (CpuBuildError, CpuKernelError, OSError) as exc:
        log.warning("the native CPU kernels are unavailable (%s); the plain-torch ops and torch's packed "
                    "kernels run instead", exc)
        return None
    log.info("native CPU kernels: the %s variant (%s)%s, %s", kernels.variant, why, _loops_note(kernels), kernels.path)
    return kernels


def _loops_note(kernels: CpuKernels) -> str:
    """What the start-up log says of the packed matmuls' loops beyond the VNNI loop (empty: that loop alone)."""
    if kernels.uses_amx:
        return ("; AMX tiles granted (the packed matmuls' bfloat16 tile loop for prompt tokens, and the VNNI loop's "
                "exact int8 tiles from 16 rows a call)")
    if kernels.variant == "amx-bf16":
        return "; Linux refused the AMX tiles: prompt tokens take the bfloat16 vector loop, the rest the AVX-512 VNNI loop"
    if kernels.prompt_loop == "vectors":
        return "; the packed matmuls' bfloat16 vector loop for prompt tokens (AVX512-BF16)"
    return ""
