"""llama.cpp's own `llama-server`, built with cmake from the llama.cpp sources inside llama-cpp-python's sdist.

PyPI is the only registry these machines reach, so the sources come from the llama-cpp-python sdist
(`pip download --no-binary llama-cpp-python --no-deps`: only this package as source, its build tools as wheels), which vendors llama.cpp with its tools/server. The build is
cached: a rerun finds the binary and starts at once. `-np N -cb` gives N parallel slots with continuous
batching, so concurrent requests are decoded together.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from peers.common import SetupError, cache_dir, run_logged
from peers.peer import Context, Launch

VERSION = "0.3.36"  # llama-cpp-python, whose sdist carries the llama.cpp sources
SDIST = f"llama-cpp-python=={VERSION}"


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
    """Build `llama-server` once (about 6 minutes on two cores) and return its path."""
    src = source_dir()
    build = cache_dir() / "llama-cpp" / "build"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    jobs = str(os.cpu_count() or 2)
    run_logged(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"], "llama-cpp-build")
    run_logged(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], "llama-cpp-build")
    if not binary.is_file():
        raise SetupError(f"the build finished but {binary} is missing")
    return binary


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
    return Launch(command, model="smollm2", version=version(), start_timeout_s=120.0)
