"""A sparse MoE block in one native call (``csrc/moe_mix.c``).

``ExpertMix.mix`` is what ``models.sparse_moe.mix_experts`` does in Python, a dozen torch ops and three kernel calls an
expert, with the same kernels in the same order, so the results are its bits (tested). ``ExpertMix.block`` is the
whole ``SparseMoeBlock.forward``: the router (its logits, softmax, top_k and renormalization in C), the experts and
the shared expert with its sigmoid gate; the native decode stack (``native_decode.py``) runs the same C for an MoE
layer, so a decode step gives the same bits through the modules and through the stack.

It takes experts that are ``LlamaMLP``s with silu, every projection a ``NativeWeight`` multiplied by the packed
kernel, on the CPU, in float32 or bfloat16, with no hooks; ``block`` also a ``SparseMoeBlock``'s own routing (not a
subclass's) and a shared expert of the same kind. A token's rows take the loop its row of the step takes
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

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class MoeStruct(ctypes.Structure):  # csrc/common.h core_moe
    _fields_ = [("router", _P), ("router_bias", _P), ("gate_up", _P), ("down", _P), ("shared", _P),
                ("shared_gate", _P), ("experts", _L), ("top_k", _L), ("inter", _L), ("normalize", _I),
                ("softmax_of_top_k", _I)]


class ExpertMix:
    """One block's experts (``of(experts)``) or whole block (``of_block(block)``) as ``csrc/moe_mix.c`` runs them;
    None from either where they do not fit (see the module docstring)."""

    def __init__(self, experts: Sequence[nn.Module], gate_up: ctypes.Array, down: ctypes.Array, inter: int,
                 keep: list) -> None:
        first = experts[0].gate_up_proj.weight
        self.kernels = first.kernels
        self.prompt_loop = first.kernels.prompt_loop is not None
        self.gate_up, self.down, self.inter, self.keep = gate_up, down, inter, keep
        self.count = len(experts)
        self.moe: MoeStruct | None = None  # the whole block, where of_block described it
        self.router_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, experts: Sequence[nn.Module]) -> ExpertMix | None:
        if not experts or not all(_is_swiglu(e) for e in experts):
            return None
        keep: list = []
        gate_up = [packed_of(e.gate_up_proj, keep) for e in experts]
        down = [packed_of(e.down_proj, keep) for e in experts]
        if any(p is None for p in gate_up + down):
            return None
        inter = experts[0].down_proj.weight.shape[1]
        if any(p.n != 2 * inter for p in gate_up) or any(e.down_proj.weight.shape[1] != inter for e in experts):
            return None
        return cls(experts, (Packed * len(gate_up))(*gate_up), (Packed * len(down))(*down), inter, keep)

    @classmethod
    def of_block(cls, block: nn.Module) -> ExpertMix | None:
        """The whole block, where its experts fit, its routing is ``SparseMoeBlock``'s own, its router a plain float
        CPU weight and its shared expert (if any) fits as the experts do; else its experts alone (``of``), or None."""
        from ..models.sparse_moe import SparseMoeBlock

        mixer = cls.of(block.experts)
        if mixer is None or type(block).routing is not SparseMoeBlock.routing:
            return mixer
        router = block.gate
        if (router._forward_hooks or router._forward_pre_hooks or router.weight.dtype not in DTYPE_CODES
                or router.weight.device.type != "cpu"):
            return mixer
        shared = None
        if block.shared_expert is not None:
            if not _is_swiglu(block.shared_expert):
                return mixer
            shared = [packed_of(block.shared_expert.gate_up_proj, mixer.keep),
                      packed_of(block.shared_expert.down_proj, mixer.keep)]
            if None in shared:
                return mixer
            shared = (Packed * 2)(*shared)
            mixer.keep.append(shared)
        mixer.moe = MoeStruct(
            router=_pointer(router.weight.detach(), mixer.keep),
            router_bias=None if router.bias is None else _pointer(router.bias.detach().float(), mixer.keep),
            gate_up=ctypes.addressof(mixer.gate_up), down=ctypes.addressof(mixer.down),
            shared=None if shared is None else ctypes.addressof(shared),
            shared_gate=(None if block.shared_expert_gate is None
                         else _pointer(block.shared_expert_gate.weight.detach().to(router.weight.dtype), mixer.keep)),
            experts=mixer.count, top_k=block.top_k, inter=mixer.inter, normalize=int(block.normalize),
            softmax_of_top_k=int(block.softmax_of_top_k))
        mixer.router_dtype = router.weight.dtype
        return mixer

    def mix(self, hidden: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """``mix_experts``' output [T, H], or None where the dtypes or the device are not the kernel's."""
        if not _fits(hidden) or weights.dtype != hidden.dtype:
            return None
        tiled = self._tiled(hidden.shape[0])
        hidden, weights = hidden.contiguous(), weights.contiguous()  # named: alive during the call
        chosen = chosen.to(torch.int64).contiguous()
        out = torch.empty_like(hidden)
        self.kernels.call("core_moe_mix", hidden.data_ptr(), DTYPE_CODES[hidden.dtype], hidden.shape[0],
                          hidden.shape[1], chosen.shape[1], chosen.data_ptr(), weights.data_ptr(),
                          None if tiled is None else tiled.data_ptr(), self.count, self.gate_up, self.down,
                          self.inter, out.data_ptr())
        return out

    def block(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The block's output [T, H] (routed, mixed, the shared expert added), or None where it was not described
        whole (``moe``) or the dtypes or the device are not the kernel's."""
        if self.moe is None or not _fits(hidden) or hidden.dtype != self.router_dtype:
            return None
        tiled = self._tiled(hidden.shape[0])
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        self.kernels.call("core_moe_block", ctypes.addressof(self.moe), hidden.data_ptr(),
                          DTYPE_CODES[hidden.dtype], hidden.shape[0], hidden.shape[1],
                          None if tiled is None else tiled.data_ptr(), 0, out.data_ptr())
        return out

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``block``'s routing alone: (weights [T, top_k] of ``hidden``'s dtype, chosen experts int64 [T, top_k])."""
        hidden = hidden.contiguous()
        weights = hidden.new_empty(hidden.shape[0], self.moe.top_k)
        chosen = torch.empty(hidden.shape[0], self.moe.top_k, dtype=torch.int64)
        self.kernels.call("core_moe_route", ctypes.addressof(self.moe), hidden.data_ptr(),
                          DTYPE_CODES[hidden.dtype], hidden.shape[0], hidden.shape[1], weights.data_ptr(),
                          chosen.data_ptr())
        return weights, chosen

    def _tiled(self, tokens: int) -> torch.Tensor | None:
        """Each token's 1 where its rows take the prompt loop (uint8 [T]); None: none do (nothing marked, or marks of
        another row count: ``tile_rows.gathered``'s rule)."""
        rows = tile_rows.current() if self.prompt_loop else None
        if rows is None or rows.total != tokens:
            return None
        return rows.mask.to(torch.uint8)


def _is_swiglu(mlp: nn.Module) -> bool:
    from ..models.llama import LlamaMLP

    return (type(mlp) is LlamaMLP and type(mlp.act_fn) is SiluAndMul
            and not any(m._forward_hooks or m._forward_pre_hooks for m in mlp.modules()))


def _fits(hidden: torch.Tensor) -> bool:
    return hidden.dtype in (torch.float32, torch.bfloat16) and hidden.device.type == "cpu" and hidden.dim() == 2


def _pointer(tensor: torch.Tensor, keep: list) -> int:
    tensor = tensor.contiguous()
    keep.append(tensor)
    return tensor.data_ptr()
