"""Small files the backend keeps under its cache folder, written so that no reader sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` through a temporary file and a rename; False (nothing left behind) where
    the folder is read-only or full: a cache that cannot be written is rebuilt next time, never fatal."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
            temporary = out.name
            out.write(text)
        os.replace(temporary, path)
        return True
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        return False
