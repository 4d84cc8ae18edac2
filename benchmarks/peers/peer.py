"""What the side-by-side run knows about a peer: how to launch it, and what it needs to be launched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Context:
    """Shared inputs: the GGUF, the bfloat16 folder converted from it (on first use), a port, threads."""

    gguf: Path
    convert: Callable[[], Path]
    port: int
    threads: int = 2
    max_concurrency: int = 64
    output_len: int = 128
    _folder: Path | None = None

    @property
    def bf16_folder(self) -> Path:
        if self._folder is None:
            self._folder = self.convert()
        return self._folder


@dataclass(frozen=True)
class Launch:
    """A ready-to-run server: its command, environment, the model name clients send, its version."""

    command: list[str]
    model: str
    version: str
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"
    start_timeout_s: float = 300.0
    extra_body: dict = field(default_factory=dict)  # per-server request fields (e.g. min_tokens)
    ignore_eos: bool = True  # send `ignore_eos` (servers that reject it get a fixed length through extra_body)
    build_flags: list[str] = field(default_factory=list)  # the cmake flags of a peer built from source


@dataclass(frozen=True)
class Peer:
    """One row of the table. `launch` installs or builds what it needs (once) and may raise SetupError."""

    key: str
    label: str
    launch: Callable[[Context], Launch]
