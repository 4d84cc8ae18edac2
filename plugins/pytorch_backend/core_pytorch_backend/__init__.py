"""The pytorch backend of core (see plugin.py for what it registers).

Importing it asks torch, if torch is not imported yet, to put large CPU tensors on transparent huge
pages (``THP_MEM_ALLOC_ENABLE=1``, a PyTorch setting read once, at torch's first allocation; a value the
user set is kept). A prefill step allocates hundreds of MB of fresh activations a layer, and the kernel
faults them in 4 KiB at a time: 100 MB cost 32 ms that way and 5-7 ms on huge pages, and 64 prompts of
128 tokens prefilled in 4.5-4.8 s instead of 5.9-7.8 s (2-core Zen 5 EPYC). `huge_pages` says, for the
start-up log, whether it applies.
"""

from __future__ import annotations

import os
import sys

THP_ENV = "THP_MEM_ALLOC_ENABLE"
_TORCH_WAS_IMPORTED = "torch" in sys.modules
if not _TORCH_WAS_IMPORTED:
    os.environ.setdefault(THP_ENV, "1")


def huge_pages() -> str:
    """How torch's large CPU tensors are paged in this process, in words."""
    if _TORCH_WAS_IMPORTED:
        return (f"4 KiB pages (torch was imported before core_pytorch_backend; set {THP_ENV}=1 before importing "
                "torch for transparent huge pages)")
    if os.environ.get(THP_ENV) != "1":
        return f"4 KiB pages ({THP_ENV}={os.environ.get(THP_ENV)!r})"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    if mode == "never":
        return "4 KiB pages (transparent huge pages are off in this kernel: transparent_hugepage=never)"
    return f"transparent huge pages ({THP_ENV}=1, transparent_hugepage={mode})"
