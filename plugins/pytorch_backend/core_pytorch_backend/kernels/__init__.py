"""The one place that picks the hot ops for a device; layers only ever see the ops object.

Three sets exist: ``reference`` (plain torch: the oracle, and the fallback everywhere), ``native`` (the
CPU path: the reference with a decode step's per-layer ops in the plugin's C kernels, built on first use
with the system compiler) and ``triton`` (Triton kernels: the CUDA path). The set is chosen once, when
the model is built: Triton on a CUDA device when triton imports, native on the CPU when its kernels
build, the reference elsewhere. ``CORE_KERNELS=reference|native|triton`` or ``select_ops(device,
kind=...)`` forces a set (the tests run the Triton set on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType, SimpleNamespace

import torch

from . import reference

OP_NAMES = ("store_kv_cache", "paged_attention", "rms_norm", "apply_rotary", "silu_and_mul",
            "gelu_tanh_and_mul")
# what a set may add (sampling.py falls back to torch without them): the greedy rows' argmax, a fused sampler;
# attention whose scores are soft-capped (Gemma 2: layers.attention falls back to the reference without it); a
# LayerNorm and an ungated GELU-tanh, relu^2 and xIELU that a LayerNorm, an Activation and an XIELU built with the op
# set call (layers.norm, layers.activation: torch's without them)
OPTIONAL_OP_NAMES = ("argmax_rows", "sample_tokens", "softcapped_attention", "layer_norm", "gelu_tanh", "relu2",
                     "xielu")
KINDS = ("reference", "native", "triton")
KERNELS_ENV = "CORE_KERNELS"


def _namespace(module: ModuleType) -> SimpleNamespace:
    """The ops of ``module`` (the optional ones it has) plus its ``name`` and ``graph_safe`` (no op syncs
    with the host in decode)."""
    ops = {name: getattr(module, name) for name in OP_NAMES}
    ops.update({name: getattr(module, name) for name in OPTIONAL_OP_NAMES if hasattr(module, name)})
    return SimpleNamespace(name=module.NAME, graph_safe=getattr(module, "GRAPH_SAFE", False), **ops)


def triton_available() -> bool:
    """Whether the triton package is installed (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def default_kind(device: torch.device) -> str:
    """``triton`` on a CUDA device when triton is installed; ``native`` on the CPU when its kernels
    build (:func:`native_available`); else ``reference``."""
    if device.type == "cuda":
        return "triton" if triton_available() else "reference"
    return "native" if device.type == "cpu" and native_available() else "reference"


def native_available() -> bool:
    """Whether the native CPU kernels load (built now if need be; a failure is logged once)."""
    from ..native.library import available

    return available() is not None


def _load_triton(device: torch.device) -> ModuleType:
    if not triton_available():
        raise RuntimeError("the triton op set needs the triton package: pip install 'core-pytorch-backend[triton]'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the triton op set runs on {device.type} only under TRITON_INTERPRET=1 (set before triton is "
            "imported); on the CPU use the reference set"
        )
    return importlib.import_module(f"{__name__}.triton")


def select_ops(device: torch.device | str = "cpu", kind: str | None = None) -> SimpleNamespace:
    """The ops namespace for ``device``, chosen once at start-up.

    :param device: where the model runs.
    :param kind: ``reference`` or ``triton`` to force a set; None takes ``$CORE_KERNELS``, else the
        device's default (:func:`default_kind`).
    :raises ValueError: an unknown kind. :raises RuntimeError: triton forced where it cannot run.
    """
    device = torch.device(device)  # validates the device spelling early
    kind = kind or os.environ.get(KERNELS_ENV) or default_kind(device)
    if kind not in KINDS:
        raise ValueError(f"kind (or ${KERNELS_ENV}) must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "native":
        if not native_available():
            raise RuntimeError("the native op set needs the CPU kernels, which did not build (see the log)")
        return _namespace(importlib.import_module(f"{__name__}.native"))
    return _namespace(reference if kind == "reference" else _load_triton(device))


__all__ = ["KERNELS_ENV", "KINDS", "OP_NAMES", "default_kind", "reference", "select_ops", "triton_available"]
