"""A GGUF file's tensors under Hugging Face names, quantized ones kept as ``AffineWeight`` codes.

Names come from the gguf package's tensor-name map applied to the HF names of a meta-device skeleton of
the model (what transformers' ``get_gguf_hf_weights_map`` does) and each tensor goes through transformers'
per-architecture tensor processor, as its GGUF loader does (Llama's q/k projections, for one, are stored
with their rows permuted). A quantized tensor cannot go through the processor as numbers, so the
processor is run on probes instead: its row indices, which give the order it puts the rows in, and random
values of the tensor's rows, which must come back as those rows in that order. A tensor the processor
does more to than reorder its rows is dequantized and processed. Types without a packed form
(``gguf_blocks``) are dequantized with the gguf package.

What the processor does to each tensor depends only on the architecture and the config, so the outcome
(the name map and each tensor's row order: a ``LoadPlan``) is kept in a small JSON file under
``names_cache``, keyed by everything it depends on (the architecture, the config, the transformers and
gguf versions). Building it imports transformers' modeling module for the architecture (the skeleton:
1.7 s of a 5 s start for SmolLM2 on a 2-core EPYC) and its GGUF module (the processors: 0.23 s of a
2.4 s start on a Zen 5 EPYC); a start that finds the plan imports neither, unless a tensor needs the
processor on its values.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache_files import write_text_atomically
from ..light_config import full_config
from .affine import AffineWeight
from .gguf_blocks import unpack
from .gguf_index import TensorEntry, read_gguf_index

PLAN_FORMAT = 3  # 2: expert stacks; 3: a module-less parameter's `.weight` name
PROBE_COLUMNS = 8  # the random probe's columns: a row reordering moves whole rows, whatever their width
#: llama.cpp's stacked experts of one layer: [experts, rows, columns] weights (and gpt-oss's [experts, rows]
#: biases), one expert's gate, up or down projection after another (Qwen2/3-MoE, Mixtral, gpt-oss...)
EXPERT_STACK = re.compile(r"blk\.\d+\.ffn_(?P<projection>gate|up|down)_exps\.(?P<kind>weight|bias)")


@dataclass(frozen=True)
class TensorStep:
    """What loading does with one GGUF tensor: yield it under ``name`` with its rows in ``order`` (None:
    as stored; no name: the model does not use it), or, ``processed``, run transformers' processor on its
    dequantized values; or, for a stack of experts' ``projection`` ("gate", "up" or "down"), yield each
    expert's slice as it is stored, under ``{name}.{expert}.{projection}_proj.{weight or bias}``."""

    name: str = ""
    order: np.ndarray | None = None
    processed: bool = False
    projection: str = ""


@dataclass(frozen=True)
class LoadPlan:
    """GGUF name -> HF name, and the step of every tensor of the file."""

    names: dict[str, str]
    steps: dict[str, TensorStep]

    def to_json(self) -> str:
        orders: list[list[int]] = []  # each distinct order once: a model's layers share a few
        steps = {}
        for gguf_name, step in self.steps.items():
            if step.processed:
                steps[gguf_name] = {"processed": True}
                continue
            entry: dict[str, Any] = {"name": step.name}
            if step.projection:
                entry["projection"] = step.projection
            if step.order is not None:
                order = step.order.tolist()
                if order not in orders:
                    orders.append(order)
                entry["order"] = orders.index(order)
            steps[gguf_name] = entry
        return json.dumps({"format": PLAN_FORMAT, "names": self.names, "orders": orders, "steps": steps})

    @classmethod
    def from_json(cls, text: str) -> LoadPlan:
        """The plan ``to_json`` wrote; ValueError (KeyError, TypeError, IndexError...) where it is not one."""
        data = json.loads(text)
        if data["format"] != PLAN_FORMAT:
            raise ValueError(f"plan format {data['format']}, expected {PLAN_FORMAT}")
        orders = [np.asarray(order, dtype=np.int64) for order in data["orders"]]
        steps = {}
        for gguf_name, entry in data["steps"].items():
            if entry.get("processed"):
                steps[gguf_name] = TensorStep(processed=True)
            else:
                order = entry.get("order")
                steps[gguf_name] = TensorStep(str(entry["name"]), None if order is None else orders[order],
                                              projection=str(entry.get("projection", "")))
        return cls({str(k): str(v) for k, v in data["names"].items()}, steps)


def gguf_weights(gguf: Path, config: Any, names_cache: Path | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
    """(HF name, dense tensor or quantized codes) for every tensor the model uses: float32, but a 2-D F16 /
    BF16 tensor in its own 16-bit dtype (exact: a float32 parameter takes it as float32 values, and
    ``native.half_weights`` can keep it as it is); the load plan is read from (or written to) the folder
    ``names_cache`` where one is given."""
    index = read_gguf_index(gguf)
    plan = load_plan(index.architecture, config, index.tensors, names_cache)
    processor = None
    for tensor in index.tensors:
        step = plan.steps[tensor.name]
        if step.processed:
            processor = processor or _processor(index.architecture, config)
            result = _processed(processor, _dequantized(tensor), tensor.name, plan.names)
            if result.name in plan.names:
                yield plan.names[result.name], torch.from_numpy(np.array(result.weights, dtype=np.float32))
            continue
        if not step.name:
            continue
        if step.projection:
            kind = tensor.name.rpartition(".")[2]
            for expert, part in enumerate(_expert_slices(tensor)):
                yield f"{step.name}.{expert}.{step.projection}_proj.{kind}", _as_stored(part, None)
            continue
        yield step.name, _as_stored(tensor, step.order)


def _as_stored(tensor: TensorEntry, order: np.ndarray | None) -> torch.Tensor | AffineWeight:
    """A tensor of the file with its rows in ``order`` (None: as stored): a 2-D block-quantized one as its
    packed codes, a 2-D 16-bit one in its own dtype, any other as float32."""
    codes = unpack(tensor.type_name, tensor.data) if len(tensor.shape) == 2 else None
    if codes is not None:
        return codes if order is None else codes.rows(order)
    if tensor.type_name in SIXTEEN_BIT and len(tensor.shape) == 2:
        values = _sixteen_bit(tensor)
        return values if order is None else values[torch.from_numpy(order)]
    values = np.array(_dequantized(tensor), dtype=np.float32)
    return torch.from_numpy(values if order is None else values[order])


def _expert_slices(tensor: TensorEntry) -> Iterator[TensorEntry]:
    """Each expert's part of a stack of experts ([experts, rows, columns] weights, [experts, rows] biases) as a
    tensor of the file of its own (F32 / F16 data comes shaped; other types' as [rows, bytes a row], every
    expert's rows one after another)."""
    shaped = tensor.type_name in ("F32", "F16")
    rows = int(np.prod(tensor.shape[1:-1]))  # an expert's rows of bytes (1 for a bias)
    for expert in range(tensor.shape[0]):
        data = tensor.data[expert] if shaped else tensor.data[expert * rows : (expert + 1) * rows]
        yield TensorEntry(tensor.name, tensor.type_name, tensor.shape[1:], data)


SIXTEEN_BIT = {"F16": torch.float16, "BF16": torch.bfloat16}


def _sixteen_bit(tensor: TensorEntry) -> torch.Tensor:
    """An F16 / BF16 tensor's values, copied out of the mapped file, in their own dtype."""
    raw = np.array(tensor.data).view(np.uint16).reshape(tensor.shape)
    return torch.from_numpy(raw).view(SIXTEEN_BIT[tensor.type_name])


def _dequantized(tensor: TensorEntry) -> np.ndarray:
    if tensor.type_name in ("F32", "F16"):
        return np.asarray(tensor.data, dtype=np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)


def load_plan(architecture: str, config: Any, tensors: list[TensorEntry], names_cache: Path | None = None
              ) -> LoadPlan:
    """The plan for ``tensors`` of a file of ``architecture`` and ``config`` (from ``names_cache`` when it
    holds one with a step for each of them; else built and written there)."""
    cached = None if names_cache is None else Path(names_cache) / f"gguf-plan-{_plan_key(architecture, config)}.json"
    if cached is not None and cached.is_file():
        try:
            plan = LoadPlan.from_json(cached.read_text())
            if all(t.name in plan.steps for t in tensors):
                return plan
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            pass  # unreadable: built again and rewritten
    processor = _processor(architecture, config)
    names = _names(architecture, config, processor)
    # a fresh processor for each tensor's probes: some keep state between calls (MoE experts)
    plan = LoadPlan(names, {t.name: _step(_processor(architecture, config), t, names) for t in tensors})
    if cached is not None:
        write_text_atomically(cached, plan.to_json())
    return plan


def _processor(architecture: str, config: Any) -> Any:
    """transformers' tensor processor for the file's architecture."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _plan_key(architecture: str, config: Any) -> str:
    parts = (str(PLAN_FORMAT), architecture, config.to_json_string(use_diff=False),
             importlib.metadata.version("transformers"), _version("gguf"))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _names(architecture: str, config: Any, processor: Any) -> dict[str, str]:
    """GGUF name -> HF name, as transformers' ``get_gguf_hf_weights_map`` over a meta-device skeleton,
    with one tensor-name map for the whole model (that function builds one per submodule: seconds here)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {architecture!r} is unknown to the gguf package")
    text_config = config.get_text_config()
    name_map = get_tensor_name_map(arch, text_config.num_hidden_layers)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(full_config(config))
    names: dict[str, str] = {}
    for hf_name in skeleton.state_dict():
        hf_name = processor.preprocess_name(hf_name)
        base, dot, suffix = hf_name.rpartition(".")
        base, suffix = (base, dot + suffix) if suffix in ("weight", "bias") else (hf_name, "")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(names, suffix, "", hf_name)
        else:
            names[gguf_name + suffix] = hf_name
            if not suffix:  # a parameter without a module (gpt-oss's sinks): llama.cpp names it as a weight
                names.setdefault(gguf_name + ".weight", hf_name)
    return names


def _step(processor: Any, tensor: TensorEntry, names: dict[str, str]) -> TensorStep:
    """What the processor does to ``tensor``, from probes (see the module docstring); a stack of experts
    ``_expert_stack``'s step."""
    if (stack := _expert_stack(tensor, names)) is not None:
        return stack
    if len(tensor.shape) not in (1, 2):
        return TensorStep(processed=True)  # expert stacks and the like: too large to probe, and not reordered
    rows = tensor.shape[0]
    probe = np.random.default_rng(0).standard_normal(
        (rows, min(tensor.shape[1], PROBE_COLUMNS)) if len(tensor.shape) == 2 else tensor.shape)
    try:
        moved = _processed(processor, probe, tensor.name, names)
        indices = None if len(tensor.shape) == 1 else _processed(
            processor, np.arange(rows, dtype=np.float64)[:, None], tensor.name, names)
    except Exception:  # noqa: BLE001 (a processor that cannot take a probe is run on the values)
        return TensorStep(processed=True)
    if moved.name not in names:
        return TensorStep()  # not used
    name, result = names[moved.name], np.asarray(moved.weights)
    if indices is None:  # a vector: kept only where the processor leaves it as it is
        unchanged = result.shape == probe.shape and np.array_equal(result, probe)
        return TensorStep(name) if unchanged else TensorStep(processed=True)
    order = _row_order(np.asarray(indices.weights), rows)
    if order is None or result.shape != probe.shape or not np.array_equal(result, probe[order]):
        return TensorStep(processed=True)
    return TensorStep(name, None if np.array_equal(order, np.arange(rows)) else order)


def _expert_stack(tensor: TensorEntry, names: dict[str, str]) -> TensorStep | None:
    """The step of llama.cpp's stack of one layer's experts (``EXPERT_STACK``), each expert's slice kept as it
    is stored (its rows are the expert's output features, as an HF checkpoint's ``experts.{e}.*_proj`` holds
    them), under the model's experts module: the HF name the name map gives the stack (a fused
    ``...experts.gate_up_proj`` / ``...experts.down_proj``, or ``...experts.gate_proj``...) less its last part.
    None where the tensor is not such a stack or the model has no experts there."""
    match = EXPERT_STACK.fullmatch(tensor.name)
    if match is None or len(tensor.shape) != (3 if match["kind"] == "weight" else 2):
        return None
    layer = tensor.name.partition(".ffn_")[0]  # a stack the name map misses (Mixtral's fused gate_up_proj) goes
    candidates = (match["projection"], "down", "gate", "up")  # under the module its layer's other stacks map to
    hf_name = next((names[key] for projection in candidates for key in (f"{layer}.ffn_{projection}_exps.weight",
                                                                        f"{layer}.ffn_{projection}_exps")
                    if key in names), None)
    if not hf_name:
        return None
    experts_module = hf_name.removesuffix(".weight").rpartition(".")[0]
    return TensorStep(experts_module, projection=match["projection"])


def _row_order(indices: np.ndarray, rows: int) -> np.ndarray | None:
    """The row order a processor's output of the row indices [rows, 1] shows (None: not a reordering)."""
    if indices.shape != (rows, 1) or not np.array_equal(np.sort(indices[:, 0]), np.arange(rows)):
        return None
    return indices[:, 0].astype(np.int64)


def _processed(processor: Any, weights: np.ndarray, name: str, names: dict[str, str]) -> Any:
    return processor.process(weights=weights, name=name, tensor_key_mapping=names, parsed_parameters={"tensors": {}})
