"""Where core and its plugins keep what they build or convert once and reuse at every start.

``$CORE_CACHE_DIR/<name>``, default ``~/.cache/core/<name>``: ``cpu`` and ``cuda`` (compiled kernel
libraries, keyed by a hash of their sources, flags and compiler), ``gguf`` (a GGUF file's config,
tokenizer, load plan and, for a dense load, its dequantized weights, keyed by the file's content).
Everything there is rebuilt when missing: the folder may be deleted at any time (the next start is
slower). Read at each call, so that a test or a process that sets the variable late is obeyed.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "CORE_CACHE_DIR"


def cache_folder(name: str) -> Path:
    """The cache folder ``name`` (not created here): ``$CORE_CACHE_DIR/name`` or ``~/.cache/core/name``."""
    root = os.environ.get(CACHE_VARIABLE)
    return (Path(root) if root else Path.home() / ".cache" / "core") / name
