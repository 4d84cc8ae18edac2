"""sentence-transformers' Dense modules (a pooled embedding through a linear layer and an activation, as LaBSE
and distiluse project theirs), read from their folders in a checkpoint as one float32 torch module that the
pooling path applies before the normalisation (`core.pooling.PoolingConfig.projections`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from core.errors import UnsupportedError

#: the activations sentence-transformers' Dense names by class path (Tanh is its default)
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.activation.Tanh": nn.Tanh, "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU, "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}


def load_projection(folder: str | Path, paths: Sequence[str], device: torch.device) -> nn.Module | None:
    """The Dense modules under ``paths`` of ``folder``, in order, or None when there are none."""
    if not paths:
        return None
    layers: list[nn.Module] = []
    for path in paths:
        module = Path(folder) / path
        config = json.loads((module / "config.json").read_text())
        activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in ACTIVATIONS:
            raise UnsupportedError(f"{module}: the Dense module's activation {activation!r} is not supported "
                                   f"({', '.join(sorted(ACTIVATIONS))} are)", param="model")
        linear = nn.Linear(int(config["in_features"]), int(config["out_features"]), bias=bool(config.get("bias", True)))
        linear.load_state_dict({name.removeprefix("linear."): value for name, value in _weights(module).items()})
        layers += [linear, ACTIVATIONS[activation]()]
    return nn.Sequential(*layers).float().to(device).eval()


def _weights(module: Path) -> dict[str, torch.Tensor]:
    """A Dense module's tensors: model.safetensors (sentence-transformers 3+) or pytorch_model.bin (older)."""
    if (module / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(module / "model.safetensors"))
    if (module / "pytorch_model.bin").is_file():
        return torch.load(module / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UnsupportedError(f"{module}: the Dense module has no model.safetensors or pytorch_model.bin", param="model")
