"""Reading a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) for a built model.

Every check runs before anything is loaded, and each failure is a 400 naming the field: a missing file,
a PEFT type other than LoRA, ``modules_to_save`` (full copies of layers, which a shared base cannot
hold), DoRA, LoRA biases, per-module rank or alpha patterns, a rank above ``--max-lora-rank``, a target
the model lacks, or shapes that do not fit the base (another hidden size).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.errors import InvalidRequestError
from core_pytorch_backend.layers.linear import Linear, MergedLinear
from core_pytorch_backend.models.llama import STACKED_PARAMS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
Shards = dict[int, tuple[torch.Tensor, torch.Tensor]]  # shard index -> (A [r, in], scaled B [out, r])


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter read for one model: per targeted layer (our module name), its shards' A and scaled B."""

    rank: int
    layers: dict[str, Shards]


def lora_targets(model: nn.Module) -> dict[str, tuple[str, int]]:
    """HF module name (``model.layers.0.self_attn.q_proj``) -> (our layer's name, shard index)."""
    targets: dict[str, tuple[str, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            for index, shard in enumerate(module.shard_names):
                targets[_hf_name(name, shard)] = (name, index)
        elif isinstance(module, Linear):
            targets[name] = (name, 0)
    return targets


def _hf_name(fused_name: str, shard: str) -> str:
    dotted = f"{fused_name}."
    for fused, part, shard_name in STACKED_PARAMS:
        if shard_name == shard and fused in dotted:
            return dotted.replace(fused, part).rstrip(".")
    return f"{fused_name}.{shard}"


def read_adapter(path: str, model: nn.Module, max_rank: int) -> AdapterWeights:
    """The adapter in folder `path`, checked against `model` (see the module docstring)."""
    folder = Path(path)
    config = _read_config(folder)
    rank = _check_config(config, max_rank)
    scale = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(folder)
    return AdapterWeights(rank, _layers(tensors, model, scale))


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise InvalidRequestError(f"lora_path {str(folder)!r} is not a folder", param="lora_path")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise InvalidRequestError(f"lora_path has no {name} (a PEFT adapter folder holds {CONFIG_FILE} "
                                      f"and {WEIGHTS_FILE})", param="lora_path")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{CONFIG_FILE} is not valid JSON ({exc})", param="lora_path") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{CONFIG_FILE} must hold a JSON object", param="lora_path")
    return config


def _check_config(config: dict[str, Any], max_rank: int) -> int:
    def refuse(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{CONFIG_FILE}: {message}", param="lora_path")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']!r} is not supported: it replaces whole "
                     "layers, which adapters sharing one base model cannot do")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config['bias']!r} is not supported (only 'none')")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise refuse("per-module rank_pattern / alpha_pattern are not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InvalidRequestError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}",
                                  param="lora_path")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    return rank


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / WEIGHTS_FILE))
    except Exception as exc:  # a truncated or foreign file
        raise InvalidRequestError(f"{WEIGHTS_FILE} cannot be read ({type(exc).__name__})", param="lora_path") from None


def _layers(tensors: dict[str, torch.Tensor], model: nn.Module, scale: float) -> dict[str, Shards]:
    targets = lora_targets(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            raise InvalidRequestError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B matrix of a linear "
                                      "layer", param="lora_path")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    layers: dict[str, Shards] = {}
    for hf_name, pair in pairs.items():
        if hf_name not in targets:
            raise InvalidRequestError(f"the adapter targets {hf_name!r}, which this model does not have "
                                      "(another base model?)", param="lora_path")
        if set(pair) != {"A", "B"}:
            raise InvalidRequestError(f"{hf_name}: lora_A and lora_B must both be present", param="lora_path")
        name, shard = targets[hf_name]
        a, b = _checked(hf_name, pair["A"], pair["B"], model.get_submodule(name), shard)
        layers.setdefault(name, {})[shard] = (a.float(), b.float() * scale)
    return layers


def _checked(hf_name: str, a: torch.Tensor, b: torch.Tensor, layer: Linear, shard: int):
    out = layer.output_sizes[shard] if isinstance(layer, MergedLinear) else layer.output_size
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise InvalidRequestError(f"{hf_name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                  "pair up", param="lora_path")
    if a.shape[1] != layer.input_size or b.shape[0] != out:
        raise InvalidRequestError(
            f"{hf_name}: the adapter was made for another base model: it maps {a.shape[1]} -> {b.shape[0]} "
            f"features, this model's layer {layer.input_size} -> {out}", param="lora_path")
    return a, b
