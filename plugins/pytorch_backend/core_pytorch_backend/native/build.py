"""Compile the CPU kernels (csrc/*.c) with the system C compiler into a shared library, cached on disk.

One variant per instruction set, picked from the flags the CPU reports (``/proc/cpuinfo``):
``amx-bf16`` (``avx512-bf16`` plus AVX512-VBMI and AMX-TILE/AMX-BF16/AMX-INT8, whose tiles multiply a prompt's
rows by the packed weights, and the VNNI loop's integer dots from 16 rows a call: Sapphire Rapids and later
Xeons; native/tile_rows.py), ``avx512-bf16``
(``avx512-vnni`` plus AVX512-BF16, whose dot products multiply a bfloat16 KV cache in decode attention:
Zen 4/5), ``avx512-vnni`` (AVX-512 F/BW/VL + VNNI:
Ice Lake), ``avx2`` (AVX2 + FMA: every x86 server CPU of the last decade) and ``generic`` (plain C, any
CPU; also the tests' reference). Each
variant is built only with the flags its instructions need (never ``-march=native``, which would use
instructions of this machine's CPU that another machine sharing the cache may lack).

``CORE_CPU_KERNELS=avx2`` (or another variant's name) overrides the choice, as ``ATEN_CPU_CAPABILITY``
does torch's: to serve as a CPU without AVX-512 would (to compare kernels, or where a VM's flags mislead);
a variant this CPU cannot run is refused by name.

Libraries are cached under ``$CORE_CACHE_DIR/cpu`` (default ``~/.cache/core/cpu``), keyed by a hash of
the sources, the flags and the compiler's version; a build takes about a second. Nothing here imports
torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from core.cache_folder import cache_folder
from core.errors import InvalidRequestError

CSRC = Path(__file__).parent / "csrc"
LIBRARY_STEM = "core_cpu_kernels"
# -fno-math-errno: expf in a loop may use glibc's vector versions (libmvec); nothing reads errno.
# -fno-trapping-math: nothing reads the floating-point exception flags either, and without it GCC 12 cannot
# if-convert a compare (fast_exp's clamp) into an AVX2 blend, so the exp loops (silu, the softmax of
# attention) stayed scalar in the avx2 build (AVX-512's masks did not need it; values are unchanged)
COMMON_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wall")
VARIANT_FLAGS = {
    "amx-bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma",
                 "-mf16c", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
    "avx512-bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma",
                    "-mf16c"),
    "avx512-vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}
VARIANT_CPU_FLAGS = {  # what /proc/cpuinfo must list for a variant to run
    "amx-bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c", "avx512vbmi",
                 "amx_tile", "amx_bf16", "amx_int8"},
    "avx512-bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c"},
    "avx512-vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "generic": set(),
}


class CpuBuildError(RuntimeError):
    """No C compiler, or it failed; the message carries the command and the compiler's output."""


def cache_dir() -> Path:
    """Where built libraries live: ``$CORE_CACHE_DIR/cpu`` or ``~/.cache/core/cpu``."""
    return cache_folder("cpu")


@cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU, from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def best_variant(flags: frozenset[str] | None = None) -> str:
    """The fastest variant this CPU can run (``generic`` when it lists none of the others' flags)."""
    flags = cpu_flags() if flags is None else flags
    return next(name for name, needed in VARIANT_CPU_FLAGS.items() if needed <= flags)


VARIANT_VARIABLE = "CORE_CPU_KERNELS"


def chosen_variant(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The variant to serve with and why: ``$CORE_CPU_KERNELS`` where set, else this CPU's best.

    Raises InvalidRequestError (a ValueError) naming the variable for an unknown variant or one whose
    instructions the CPU lacks."""
    flags = cpu_flags() if flags is None else flags
    asked = os.environ.get(VARIANT_VARIABLE, "").strip()
    if not asked:
        return best_variant(flags), "chosen from this CPU's flags"
    if asked not in VARIANT_CPU_FLAGS:
        raise InvalidRequestError(f"{VARIANT_VARIABLE} must be one of {', '.join(VARIANT_CPU_FLAGS)}, got {asked!r}",
                                  param=VARIANT_VARIABLE)
    missing = VARIANT_CPU_FLAGS[asked] - flags
    if missing:
        raise InvalidRequestError(f"{VARIANT_VARIABLE}={asked} needs CPU flags this CPU does not list: "
                                  f"{', '.join(sorted(missing))}", param=VARIANT_VARIABLE)
    return asked, f"set by {VARIANT_VARIABLE}"


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((found for name in candidates if (found := shutil.which(name))), None)


def _flags(variant: str) -> list[str]:
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"variant must be one of {', '.join(VARIANT_FLAGS)}, got {variant!r}")
    return [*COMMON_FLAGS, *VARIANT_FLAGS[variant]]


def build_key(variant: str, cc: str, sources: Path | None = None) -> str:
    """Hash of everything that changes the library: sources (default csrc/), flags, the compiler's version."""
    sources = sources or CSRC
    digest = hashlib.sha256()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    for part in (version, *_flags(variant)):
        digest.update(part.encode() + b"\0")
    for path in sorted(sources.glob("*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_library(variant: str | None = None, *, force: bool = False, sources: Path | None = None) -> Path:
    """The shared library of ``variant`` (default: ``chosen_variant()``), from the cache or compiled now.
    ``sources``: another folder of the kernels' C files (benchmarks/kernel_ab.py builds an earlier
    revision's beside this one's)."""
    variant, sources = variant or chosen_variant()[0], sources or CSRC
    cc = compiler()
    if cc is None:
        raise CpuBuildError("no C compiler found (set CC, or install gcc) to build the CPU kernels")
    target = cache_dir() / f"{LIBRARY_STEM}-{variant}-{build_key(variant, cc, sources)}.so"
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as tmp:
        built = Path(tmp) / target.name
        objects = _compile_all(cc, variant, sorted(sources.glob("*.c")), Path(tmp))
        _run_compiler([cc, *_flags(variant), *map(str, objects), "-o", str(built), "-lm"])
        os.replace(built, target)  # atomic: a concurrent builder never sees half a file
    return target


def _compile_all(cc: str, variant: str, sources: list[Path], folder: Path) -> list[Path]:
    """Each source compiled to an object in ``folder``, all at once (the CPU's cores share them: a first
    start on a 2-core machine waits for the slowest file rather than for all of them in a row); the objects,
    in the order of ``sources``."""
    flags = [flag for flag in _flags(variant) if flag != "-shared"]
    objects = [folder / f"{source.stem}.o" for source in sources]
    commands = [[cc, *flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(sources, objects, strict=True)]
    running = [(command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
               for command in commands]
    failures = []
    for command, process in running:
        out, err = process.communicate()
        if process.returncode != 0:
            failures.append(_failure(command, process.returncode, out, err))
    if failures:
        raise CpuBuildError("\n".join(failures))
    return objects


def _run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise CpuBuildError(_failure(command, result.returncode, result.stdout, result.stderr))


def _failure(command: list[str], code: int, out: str, err: str) -> str:
    return f"the C compiler failed (exit {code}):\n  {' '.join(command)}\n{err.strip() or out.strip()}"
