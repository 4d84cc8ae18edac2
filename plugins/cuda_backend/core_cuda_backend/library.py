"""The compiled kernels as a Python object: ctypes signatures, status checks, one load per process.

Why ctypes and a C ABI rather than a torch extension: the kernels take raw device pointers, sizes,
strides, a dtype code and the caller's ``cudaStream_t``, so building them needs only nvcc (no CUDA build
of torch, no matching compiler ABI, no torch headers), and a library built once serves every torch
version. The cost is a few microseconds of ctypes overhead per launch, which CUDA graphs remove for the
decode steps that matter. Tensors are passed as ``tensor.data_ptr()``; the stream is
``torch.cuda.current_stream().cuda_stream``, so launches follow torch's stream order and can be captured.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

ABI_VERSION = 1
DTYPE_NAMES = {"float32": 0, "float16": 1, "bfloat16": 2}  # csrc/common.cuh DTypeCode

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, list] = {
    "core_store_kv_cache": [_P, _P, _P, _P, _P, _I, _I, _I, _L, _L, _L, _L, _I, _P],
    "core_paged_decode_attention": [_P, _L, _L, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F,
                                    _I, _I, _I, _P],
    "core_paged_prefill_attention": [_P, _L, _L, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I,
                                     _I, _P],
    "core_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _L, _L, _F, _I, _P],
    "core_apply_rotary": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _L, _L, _L, _L, _I, _P],
    "core_silu_and_mul": [_P, _P, _I, _I, _L, _I, _P],
    "core_sample": [_P, _L, _I, _I, _P, _P, _P, _P, _P, _L, _P, _P],
}


class CudaKernelError(RuntimeError):
    """A kernel refused its arguments or its launch failed; the message names the kernel and the cause."""


class KernelLibrary:
    """The loaded shared library; ``call(name, *args)`` launches and raises on a non-zero status."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.core_abi_version.restype = ctypes.c_int
        self._lib.core_status_string.restype = ctypes.c_char_p
        self._lib.core_status_string.argtypes = [ctypes.c_int]
        self._lib.core_paged_decode_partition_size.restype = ctypes.c_int
        version = self._lib.core_abi_version()
        if version != ABI_VERSION:
            raise CudaKernelError(f"{self.path} has C ABI version {version}, expected {ABI_VERSION}; rebuild it")
        self._functions = {}
        for name, argtypes in SIGNATURES.items():
            function = getattr(self._lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            self._functions[name] = function
        self.partition_size = int(self._lib.core_paged_decode_partition_size())

    def status_string(self, status: int) -> str:
        """Text of a status code returned by a kernel entry point."""
        return self._lib.core_status_string(status).decode()

    def call(self, name: str, *args) -> None:
        """Call entry point ``name``; a non-zero status becomes a CudaKernelError."""
        status = self._functions[name](*args)
        if status != 0:
            raise CudaKernelError(f"{name}: {self.status_string(status)} (status {status})")


@functools.cache
def load_library(archs: Sequence[str] | None = None) -> KernelLibrary:
    """The kernels for ``archs`` (default: the current GPU's architecture), built on first use."""
    from core_cuda_backend.build import build_library, device_arch

    return KernelLibrary(build_library(tuple(archs) if archs else (device_arch(),)))
