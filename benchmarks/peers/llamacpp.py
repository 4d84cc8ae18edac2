"""llama.cpp's own `llama-server`, built with cmake from the llama.cpp sources inside llama-cpp-python's sdist.

PyPI is the only registry these machines reach, so the sources come from the llama-cpp-python sdist
(`pip download --no-binary llama-cpp-python --no-deps`: only this package as source, its build tools as wheels), which vendors llama.cpp with its tools/server. The build is
cached: a rerun finds the binary and starts at once. `-np N -cb` gives N parallel slots with continuous
batching, so concurrent requests are decoded together.

The build names this CPU's instruction sets explicitly (`ggml_cpu_flags`, from /proc/cpuinfo) instead of
`GGML_NATIVE=ON`: `-march=native` on the AMX Xeons these machines have gives a binary that dies with
"Illegal instruction", so AMX stays off. The build folder is keyed by the cmake flags, so a machine with
another CPU builds its own.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from peers.common import SetupError, cache_dir, run_logged
from peers.cpu import Cpu, this_cpu
from peers.peer import Context, Launch

VERSION = "0.3.36"  # llama-cpp-python, whose sdist carries the llama.cpp sources
SDIST = f"llama-cpp-python=={VERSION}"
BUILD_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what GGML_AVX512 compiles for
# ggml's x86 options (ggml/CMakeLists.txt, 0.3.36's vendored llama.cpp) and the /proc/cpuinfo flags each
# one's compiler flags need (ggml/src/ggml-cpu/CMakeLists.txt); with GGML_NATIVE=OFF the first six
# default to ON, so every one is set either way
GGML_ISA_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)), ("GGML_BMI2", ("bmi2",)), ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", AVX512), ("GGML_AVX512_VBMI", (*AVX512, "avx512vbmi")),
    ("GGML_AVX512_VNNI", (*AVX512, "avx512_vnni")), ("GGML_AVX512_BF16", (*AVX512, "avx512_bf16")),
)
GGML_AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # always off (see above)


def ggml_cpu_flags(cpu: Cpu | None = None) -> list[str]:
    """cmake flags for ggml's CPU code on `cpu` (default: this one): each x86 instruction set ON or OFF.

    Not x86 (no such options): GGML_NATIVE=ON, ggml's own choice.
    """
    cpu = cpu or this_cpu(with_torch=False)
    if cpu.machine not in ("x86_64", "AMD64"):
        return ["-DGGML_NATIVE=ON"]
    isa = [f"-D{option}={'ON' if cpu.has(*needs) else 'OFF'}" for option, needs in GGML_ISA_OPTIONS]
    return ["-DGGML_NATIVE=OFF", *isa, *(f"-D{option}=OFF" for option in GGML_AMX_OPTIONS)]


def source_dir() -> Path:
    """The unpacked llama.cpp sources (downloaded and unpacked once)."""
    root = cache_dir() / "llama-cpp"
    unpacked = root / f"llama_cpp_python-{VERSION}"
    if not (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        archive = _download(root)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        if not (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise SetupError(f"{archive.name} does not hold vendor/llama.cpp")
    return unpacked / "vendor" / "llama.cpp"


def _download(root: Path) -> Path:
    found = sorted(root.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        run_logged([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps", "--dest",
                    str(root), SDIST], "llama-cpp-download")
        found = sorted(root.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        raise SetupError(f"pip download {SDIST} left no sdist in {root}")
    return found[0]


def server_binary() -> Path:
    """Build `llama-server` once per set of cmake flags (about 6 minutes on two cores) and return its path."""
    return tool_binary("llama-server")


def tool_binary(target: str) -> Path:
    """Build llama.cpp's `target` (`llama-server`, `llama-quantize`...) once per set of cmake flags, in one
    build folder, and return its path."""
    flags = [*BUILD_FLAGS, *ggml_cpu_flags()]
    build = cache_dir() / "llama-cpp" / f"build-{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:12]}"
    binary, stamp = build / "bin" / target, build / ".core-bench-cmake-flags"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == " ".join(flags):
        return binary
    jobs = str(os.cpu_count() or 2)
    run_logged(["cmake", "-S", source_dir(), "-B", build, *flags], "llama-cpp-build")
    run_logged(["cmake", "--build", build, "--target", target, "-j", jobs], "llama-cpp-build")
    if not binary.is_file():
        raise SetupError(f"the build finished but {binary} is missing")
    check_runs(binary, flags)
    stamp.write_text(" ".join(flags))
    return binary


def check_runs(binary: Path, flags: list[str]) -> None:
    """Raise SetupError if `binary --version` dies of a signal (SIGILL: an instruction this CPU lacks)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{binary.name} --version: {exc}") from exc
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:  # a signal Python has no name for (real-time signals)
            name = f"signal {-done.returncode}"
        raise SetupError(f"{binary.name} dies with {name} on this CPU (built with {' '.join(flags)})")


def server_command(gguf: Path, port: int, parallel: int = 64, threads: int = 2) -> list[str]:
    """`llama-server` on the GGUF with `parallel` slots and continuous batching.

    Each slot gets ctx/parallel tokens of context, so the context is sized for 128+128-token requests
    with room to spare (512 per slot).
    """
    return [str(server_binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-cb", "-c", str(512 * parallel), "-t", str(threads), "-tb", str(threads),
            "--no-webui", "-a", "smollm2"]


def version() -> str:
    """llama.cpp's build as the binary reports it, e.g. "llama.cpp 1234 (abc123)"."""
    try:
        done = subprocess.run([str(server_binary()), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return f"llama.cpp (llama-cpp-python {VERSION} sources)"
    line = next((x for x in (done.stdout + done.stderr).splitlines() if x.startswith("version:")), "")
    return f"llama.cpp {line.removeprefix('version:').strip()}, from llama-cpp-python {VERSION}"


def launch(ctx: Context) -> Launch:
    command = server_command(ctx.gguf, ctx.port, parallel=max(64, ctx.max_concurrency), threads=ctx.threads)
    return Launch(command, model="smollm2", version=version(), start_timeout_s=120.0,
                  build_flags=ggml_cpu_flags())
