"""Compile the CUDA kernels (csrc/*.cu) with nvcc into one shared library, cached on disk.

The library is built on first use for the GPU at hand (or ahead of time with :func:`compile_all`) and
cached under ``$CORE_CACHE_DIR/cuda`` (default ``~/.cache/core/cuda``), keyed by a hash of the sources,
the flags, the target architectures and nvcc's version, so an edit or a new GPU rebuilds and nothing else
does. Each .cu file compiles in its own nvcc process (in parallel; one process covers every architecture
with several ``-gencode`` flags), then nvcc links the objects; the CUDA runtime is linked statically, so
the library needs only the NVIDIA driver. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.cache_folder import cache_folder
from core_cuda_backend.availability import find_nvcc

CSRC = Path(__file__).parent / "csrc"
LIBRARY_STEM = "core_cuda_kernels"
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-lineinfo")
DEFAULT_ARCHS = ("sm_80", "sm_90")
_ARCH = re.compile(r"^sm_(\d{2,3})([af]?)$")


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the command and nvcc's own output."""


def cache_dir() -> Path:
    """Where built libraries live: ``$CORE_CACHE_DIR/cuda`` or ``~/.cache/core/cuda``."""
    return cache_folder("cuda")


def sources() -> list[Path]:
    """The kernel sources, one .cu file per kernel."""
    return sorted(CSRC.glob("*.cu"))


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """``-gencode`` flags for architectures spelt like ``sm_90``; a bad spelling is a ValueError."""
    if isinstance(archs, str) or not archs:
        raise ValueError(f"archs must be a non-empty sequence like ('sm_80', 'sm_90'), got {archs!r}")
    flags = []
    for arch in archs:
        match = _ARCH.match(arch)
        if match is None:
            raise ValueError(f"archs: {arch!r} is not a CUDA architecture like 'sm_90'")
        flags.append(f"-gencode=arch=compute_{match[1]}{match[2]},code={arch}")
    return flags


def _nvcc(nvcc: str | None) -> str:
    found = nvcc or find_nvcc()
    if found is None:
        raise CudaBuildError("nvcc was not found (set CUDA_HOME or put nvcc on PATH) to build the CUDA kernels")
    return found


def build_key(archs: Sequence[str], nvcc: str) -> str:
    """Hash of everything that changes the library: sources and headers, flags, targets, nvcc version."""
    digest = hashlib.sha256()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    for part in (version, *NVCC_FLAGS, *gencode_flags(archs)):
        digest.update(part.encode() + b"\0")
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def library_path(archs: Sequence[str], nvcc: str | None = None) -> Path:
    """Where the library for ``archs`` is (or would be) cached."""
    return cache_dir() / f"{LIBRARY_STEM}-{'-'.join(archs)}-{build_key(archs, _nvcc(nvcc))}.so"


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise CudaBuildError(
            f"nvcc failed {what} (exit {result.returncode}):\n  {' '.join(command)}\n"
            f"{result.stderr.strip() or result.stdout.strip()}"
        )


def _compile_objects(nvcc: str, archs: Sequence[str], workdir: Path, jobs: int) -> list[Path]:
    flags = [*NVCC_FLAGS, *gencode_flags(archs)]

    def compile_one(source: Path) -> Path:
        obj = workdir / f"{source.stem}.o"
        _run([nvcc, *flags, "-c", str(source), "-o", str(obj)], f"compiling {source.name} for {', '.join(archs)}")
        return obj

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(compile_one, sources()))


def build_library(archs: Sequence[str], *, nvcc: str | None = None, jobs: int | None = None,
                  force: bool = False) -> Path:
    """The shared library for ``archs``: from the cache, or compiled now (raises CudaBuildError)."""
    nvcc = _nvcc(nvcc)
    archs = tuple(archs)
    target = library_path(archs, nvcc)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as tmp:
        workdir = Path(tmp)
        objects = _compile_objects(nvcc, archs, workdir, jobs or os.cpu_count() or 1)
        built = workdir / target.name
        _run([nvcc, "-shared", *gencode_flags(archs), *map(str, objects), "-o", str(built)], "linking")
        os.replace(built, target)  # atomic: a concurrent builder never sees half a file
    return target


def compile_all(archs: Sequence[str] = DEFAULT_ARCHS, **kwargs) -> Path:
    """Compile every kernel for every architecture in ``archs`` (the CI check); returns the library."""
    return build_library(archs, **kwargs)


def device_arch(device: int | None = None) -> str:
    """The ``sm_XY`` architecture of a CUDA device (needs torch with CUDA and a GPU)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"
