"""Triton versions of the hot ops, one file per op, each with its reference op's exact signature.

On a CUDA device they run compiled; on the CPU only under ``TRITON_INTERPRET=1`` (triton reads it when a
kernel is defined, so it must be set before this package is imported), which is how the tests check them
against ``kernels.reference``.

Sampling has no Triton kernel: the sampler (``sampling.py``) draws every seeded row's noise from that
request's own ``torch.Generator`` so that a seeded request gives the same tokens in any batch, which a
fused kernel's counter-based RNG cannot reproduce; greedy rows are one argmax; what is left of top-k /
top-p is one sort of the ``[B, vocab]`` logits per step, expected to be small next to a decode step's
weight reads. ``benchmarks/gpu_check.py`` times the sampler beside the decode step; revisit if it is not.
"""

from __future__ import annotations

from ..reference import gelu_tanh_and_mul  # elementwise torch, graph-safe: no kernel needed yet (Gemma only)
from .paged_attention import paged_attention
from .rms_norm import rms_norm
from .rotary import apply_rotary
from .silu_and_mul import silu_and_mul
from .store_kv_cache import store_kv_cache

NAME = "triton"
GRAPH_SAFE = True  # a decode step reads lengths and slots on the device only: CUDA graphs can capture it

__all__ = ["GRAPH_SAFE", "NAME", "apply_rotary", "gelu_tanh_and_mul", "paged_attention", "rms_norm",
           "silu_and_mul", "store_kv_cache"]
