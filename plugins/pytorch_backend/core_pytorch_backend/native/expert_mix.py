"""A sparse MoE block's experts in one native call (``csrc/moe_mix.c``): what ``models.sparse_moe.mix_experts`` does
in Python, a dozen torch ops and three kernel calls an expert, with the same kernels in the same order, so the
results are its bits (tested). The router stays in torch.

It takes experts that are ``LlamaMLP``s with silu, every projection a ``NativeWeight`` multiplied by the packed
kernel, on the CPU, in float32 or bfloat16, with no hooks. A token's rows take the loop its row of the step takes
(``tile_rows.current()``: a prompt token's the prompt loop), as ``mix_experts`` marks them (``tile_rows.gathered``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn

from ..layers.activation import SiluAndMul
from . import tile_rows
from .packed_struct import Packed, packed_of
from .packed_weight import DTYPE_CODES


class ExpertMix:
    """``mix_experts(experts, ...)`` for one block's experts in ``core_moe_mix``; ``of(experts)`` builds it, or None
    where they do not fit (see the module docstring)."""

    def __init__(self, experts: Sequence[nn.Module], gate_up: ctypes.Array, down: ctypes.Array, inter: int,
                 keep: list[torch.Tensor]) -> None:
        first = experts[0].gate_up_proj.weight
        self.kernels = first.kernels
        self.function = self.kernels.function("core_moe_mix")
        self.prompt_loop = first.kernels.prompt_loop is not None
        self.gate_up, self.down, self.inter, self.keep = gate_up, down, inter, keep
        self.count = len(experts)

    @classmethod
    def of(cls, experts: Sequence[nn.Module]) -> ExpertMix | None:
        from ..models.llama import LlamaMLP

        if not experts or any(type(e) is not LlamaMLP or type(e.act_fn) is not SiluAndMul for e in experts):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for e in experts for m in e.modules()):
            return None
        keep: list[torch.Tensor] = []
        gate_up = [packed_of(e.gate_up_proj, keep) for e in experts]
        down = [packed_of(e.down_proj, keep) for e in experts]
        if any(p is None for p in gate_up + down):
            return None
        inter = experts[0].down_proj.weight.shape[1]
        if any(p.n != 2 * inter for p in gate_up) or any(e.down_proj.weight.shape[1] != inter for e in experts):
            return None
        return cls(experts, (Packed * len(gate_up))(*gate_up), (Packed * len(down))(*down), inter, keep)

    def __call__(self, hidden: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """The mixed experts' output [T, H], or None where the dtypes or the device are not the kernel's."""
        code = DTYPE_CODES.get(hidden.dtype)
        if code is None or hidden.device.type != "cpu" or hidden.dim() != 2 or weights.dtype != hidden.dtype:
            return None
        tiled = self._tiled(hidden.shape[0])
        hidden, weights = hidden.contiguous(), weights.contiguous()  # named: alive during the call
        chosen = chosen.to(torch.int64).contiguous()
        out = torch.empty_like(hidden)
        status = self.function(hidden.data_ptr(), code, hidden.shape[0], hidden.shape[1], chosen.shape[1],
                               chosen.data_ptr(), weights.data_ptr(), None if tiled is None else tiled.data_ptr(),
                               self.count, self.gate_up, self.down, self.inter, out.data_ptr())
        if status:
            self.kernels.raise_for("core_moe_mix", status)
        return out

    def _tiled(self, tokens: int) -> torch.Tensor | None:
        """Each token's 1 where its rows take the prompt loop (uint8 [T]); None: none do (nothing marked, or marks of
        another row count: ``tile_rows.gathered``'s rule)."""
        rows = tile_rows.current() if self.prompt_loop else None
        if rows is None or rows.total != tokens:
            return None
        return rows.mask.to(torch.uint8)
