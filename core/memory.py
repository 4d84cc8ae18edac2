"""Handing freed C-heap memory back to the OS (glibc's ``malloc_trim``); nothing here imports torch.

glibc keeps freed memory in its arenas: after a large transient allocation (a model's load, a
multi-megabyte prompt rendered and tokenized on a preparation thread) the process's resident memory
stays at its peak until something trims it. The loader trims after a load, the preparation stage after a
failed preparation, and the pytorch backend's engine loop once it goes idle after steps.
"""

from __future__ import annotations

import ctypes


def trim_heap() -> bool:
    """``malloc_trim(0)`` over every arena; False where it is unavailable (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False
