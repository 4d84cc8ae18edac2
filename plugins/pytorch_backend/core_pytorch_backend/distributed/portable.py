"""A step's inputs in the form that crosses to the other ranks: tensors on the CPU, no scheduler objects."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..step_inputs import StepInputs


def portable(inputs: StepInputs) -> StepInputs:
    """`inputs` for another rank: the scheduled chunks (scheduler state) become placeholders (a worker's
    runner only counts them) and every tensor moves to the CPU (each rank pickles onto its own device)."""
    return moved(dataclasses.replace(inputs, sampling=[None] * len(inputs.sampling)), torch.device("cpu"))


def moved(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor in it (dataclass fields, tuples, lists) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {f.name: moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changed)
    if isinstance(obj, (tuple, list)):
        return type(obj)(moved(x, device) for x in obj)
    return obj
