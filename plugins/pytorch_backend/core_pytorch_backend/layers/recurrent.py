"""Layers that carry a fixed-size state per sequence instead of a KV cache: Mamba's SSM state, a gated
DeltaNet's matrix memory, a short convolution's last inputs. Hybrid models (Qwen3.5, LFM2, Granite 4.0-H,
Jamba...) interleave them with attention layers.

A `RecurrentLayer` declares its states (`state_specs`); the runner allocates each as one tensor
``[slots, *shape]`` and binds them (`allocate_recurrent_states`). A sequence holds one slot from its first
chunk to its end (the scheduler's ``StateSlots``); the step's metadata names each row's slot
(``AttentionMetadata.state_slots``). A chunk that starts at position 0 starts from a zero state, whatever
its slot held, so a slot is never cleared: a preempted sequence recomputes from its first token, and nothing
else may skip tokens (the engine turns prefix caching off and refuses speculative decoding for such models).

`segments` gives each sequence's rows of a step as one run (a recomputed sequence's prompt row and its
generated tokens' rows are consecutive: a recurrence takes them in order); `initial_states` and
`store_states` read and write a state's slots; `causal_conv1d` is the depthwise causal convolution these
mixers share, its last ``kernel - 1`` inputs kept per slot (`DepthwiseConv`: its taps as checkpoints store them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..native.library import CpuKernels, available


@dataclass(frozen=True)
class StateSpec:
    """One state of a layer, per sequence: its shape and dtype (None: the model's dtype). A recurrence's
    accumulated state is best float32 (it sums over every token); a convolution's last inputs can take the
    model's dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class RecurrentLayer(nn.Module):
    """A layer with per-sequence state. Subclasses declare ``state_specs`` and read ``self.states`` (one tensor
    ``[slots, *spec.shape]`` per spec, bound by the runner, not part of the state dict) in their forward,
    through `segments`, `initial_states`, `store_states` and `causal_conv1d`."""

    def __init__(self) -> None:
        super().__init__()
        self.states: tuple[torch.Tensor, ...] | None = None

    def state_specs(self) -> tuple[StateSpec, ...]:
        """This layer's states, per sequence."""
        raise NotImplementedError

    def bound_states(self) -> tuple[torch.Tensor, ...]:
        if self.states is None:
            raise RuntimeError(f"{type(self).__name__}: no recurrent state is bound (the runner binds it)")
        return self.states


@dataclass(frozen=True)
class Segment:
    """One sequence's rows of a step: ``[start, start + length)`` of the flat batch, its state's slot, and
    whether it starts at position 0 (its state then starts at zero)."""

    start: int
    length: int
    slot: int
    fresh: bool

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


def segments(meta: AttentionMetadata) -> tuple[Segment, ...]:
    """The step's sequences as runs of rows, consecutive rows of one slot merged (computed once a step)."""
    cached = meta.op_cache.get("recurrent_segments")
    if cached is not None:
        return cached
    if meta.state_slots is None:
        raise RuntimeError("the step names no state slots (AttentionMetadata.state_slots) for a recurrent layer")
    runs: list[Segment] = []
    row = 0
    for context, count, slot in zip(meta.context_lens_list, meta.query_lens_list, meta.state_slots, strict=True):
        if count == 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.slot == slot and last.start + last.length == row:
            runs[-1] = Segment(last.start, last.length + count, slot, last.fresh)
        else:
            runs.append(Segment(row, count, slot, context == 0))
        row += count
    result = tuple(runs)
    meta.op_cache["recurrent_segments"] = result
    return result


def all_single_rows(segs: tuple[Segment, ...]) -> bool:
    """Every sequence brings one row and continues its state: a decode step, batched across sequences."""
    return all(s.length == 1 and not s.fresh for s in segs)


def _slot_index(segs: tuple[Segment, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([s.slot for s in segs], dtype=torch.int64, device=device)


def _consecutive_slots(segs: tuple[Segment, ...]) -> int | None:
    """The first slot when the segments hold consecutive slots in order (the usual case: the scheduler hands out
    the lowest free slot, in the running sequences' order), else None."""
    first = segs[0].slot if segs else None
    if first is None or any(seg.slot != first + i for i, seg in enumerate(segs)):
        return None
    return first


def initial_states(state: torch.Tensor, segs: tuple[Segment, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[len(segs), *shape]``: each segment's state before its rows (zero for a fresh one), as ``dtype``. Where
    the segments' slots are consecutive (and no cast is asked for) this is a view of ``state``: a mixer may update
    it in place, and `store_states` of it then copies nothing."""
    first = _consecutive_slots(segs)
    if first is not None:
        out = state[first : first + len(segs)]
    else:
        out = state.index_select(0, _slot_index(segs, state.device))
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    fresh = [i for i, s in enumerate(segs) if s.fresh]
    if fresh:
        out[fresh] = 0  # assigned, not multiplied: an unwritten slot may hold NaN bit patterns
    return out


def store_states(state: torch.Tensor, segs: tuple[Segment, ...], final: torch.Tensor) -> None:
    """Write each segment's state after its rows (``final[i]`` for ``segs[i]``) back to its slot."""
    first = _consecutive_slots(segs)
    if first is None:
        state.index_copy_(0, _slot_index(segs, state.device), final.to(state.dtype))
        return
    rows = state[first : first + len(segs)]
    if rows.data_ptr() != final.data_ptr() or rows.stride() != final.stride() or rows.dtype != final.dtype:
        rows.copy_(final)  # (else the mixer updated its initial_states view in place)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  segs: tuple[Segment, ...]) -> torch.Tensor:
    """Depthwise causal convolution of each segment's rows ``x`` [T, C] with ``weight`` [C, K] (and ``bias``
    [C]), each segment continuing from the last K - 1 inputs its slot keeps in ``conv_state`` [slots, C, K - 1]
    (zeros for a fresh one), which it then updates. Returns [T, C], before any activation."""
    width = weight.shape[-1] - 1
    history = initial_states(conv_state, segs, x.dtype)  # [B, C, K - 1]
    if all_single_rows(segs):
        window = torch.cat([history, x.unsqueeze(-1)], dim=-1)  # [B, C, K]
        out = (window * weight).sum(-1)
        store_states(conv_state, segs, window[..., 1:])
        return out if bias is None else out + bias
    out = torch.empty_like(x)
    finals = []
    for i, seg in enumerate(segs):
        full = torch.cat([history[i], x[seg.rows].t()], dim=-1)  # [C, K - 1 + L]
        out[seg.rows] = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0].t()
        finals.append(full[:, full.shape[-1] - width:])
    store_states(conv_state, segs, torch.stack(finals))
    return out


class DepthwiseConv(nn.Module):
    """A depthwise causal convolution's taps as checkpoints store ``nn.Conv1d``'s (``weight`` [channels, 1, taps],
    ``bias`` [channels] or none); ``forward`` runs them through `causal_conv1d`."""

    def __init__(self, channels: int, taps: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, segs: tuple[Segment, ...]) -> torch.Tensor:
        return causal_conv1d(x, self.weight[:, 0], self.bias, conv_state, segs)


def recurrent_layers(model: nn.Module) -> list[RecurrentLayer]:
    """The model's layers with per-sequence state, in module order."""
    return [m for m in model.modules() if isinstance(m, RecurrentLayer)]


def state_bytes_per_sequence(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of recurrent state one sequence holds across the model's layers (``dtype``: the model's)."""
    return sum(math.prod(spec.shape) * (spec.dtype or dtype).itemsize
               for layer in recurrent_layers(model) for spec in layer.state_specs())


def allocate_recurrent_states(model: nn.Module, slots: int, dtype: torch.dtype | None = None,
                              device: torch.device | str | None = None,
                              keep: list[tuple[torch.Tensor, ...]] | None = None,
                              bind: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """Allocate ``slots`` slots of every recurrent layer's states (unzeroed: a fresh sequence never reads its
    slot) and bind them (``bind=False``: a store of the same shapes, e.g. the prefix cache's snapshots); ``keep``,
    the states allocated before, are copied into the first slots (growing)."""
    param = next(model.parameters())
    dtype = dtype or param.dtype
    device = device or param.device
    allocated = []
    for index, layer in enumerate(recurrent_layers(model)):
        states = tuple(torch.empty((slots, *spec.shape), dtype=spec.dtype or dtype, device=device)
                       for spec in layer.state_specs())
        if keep is not None:
            for new, old in zip(states, keep[index], strict=True):
                new[: min(len(old), slots)] = old[:slots]
        if bind:
            layer.states = states
        allocated.append(states)
    return allocated


def unbind_recurrent_states(model: nn.Module) -> None:
    for layer in recurrent_layers(model):
        layer.states = None


def copy_state_slots(model: nn.Module, copies: list[tuple[int, int]]) -> None:
    """Copy slot ``src`` to ``dst`` in every recurrent layer's states (a forked sequence's)."""
    bound = [layer.bound_states() for layer in recurrent_layers(model)]
    copy_slots_between(bound, bound, copies)


def copy_slots_between(sources: list[tuple[torch.Tensor, ...]], targets: list[tuple[torch.Tensor, ...]],
                       copies: list[tuple[int, int]]) -> None:
    """Slot ``src`` of each of ``sources``' states to slot ``dst`` of the same state in ``targets`` (per layer,
    per state), every source read before any target is written."""
    if not copies:
        return
    src, dst = (list(slots) for slots in zip(*copies, strict=True))
    for from_layer, to_layer in zip(sources, targets, strict=True):
        for source, target in zip(from_layer, to_layer, strict=True):
            target[dst] = source[src]


def native_step_kernels(state: torch.Tensor, inputs: tuple[torch.Tensor, ...], widest: int) -> CpuKernels | None:
    """The native CPU kernels where a mixer's decode step can run on them (csrc/delta_rule.c, ssd_step.c): CPU
    float32 tensors, ``state`` contiguous (updated in place) and its last dimension at most ``widest``; else None
    (torch's ops run)."""
    fits = (all(x.device.type == "cpu" and x.dtype == torch.float32 for x in (state, *inputs))
            and state.is_contiguous() and state.shape[-1] <= widest)
    return available() if fits else None
