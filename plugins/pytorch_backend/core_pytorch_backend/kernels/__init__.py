"""The one place that picks the hot ops for a device; layers only ever see the ops object."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import reference

OP_NAMES = ("store_kv_cache", "paged_attention", "rms_norm", "apply_rotary", "silu_and_mul")


def _namespace(module) -> SimpleNamespace:
    return SimpleNamespace(name=module.NAME, **{name: getattr(module, name) for name in OP_NAMES})


def select_ops(device: torch.device | str = "cpu") -> SimpleNamespace:
    """The ops namespace for ``device``, chosen once at start-up.

    Plain torch everywhere for now; a Triton set for CUDA plugs in here and nowhere else.
    """
    torch.device(device)  # validate the device spelling early
    return _namespace(reference)


__all__ = ["OP_NAMES", "select_ops", "reference"]
