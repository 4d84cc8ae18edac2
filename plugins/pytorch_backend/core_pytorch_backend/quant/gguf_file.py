"""A GGUF file's tensors under Hugging Face names, quantized ones kept as ``AffineWeight`` codes.

Names come from the gguf package's tensor-name map applied to the HF names of a meta-device skeleton of
the model (what transformers' ``get_gguf_hf_weights_map`` does) and each tensor goes through transformers' per-architecture tensor processor, as its GGUF
loader does (Llama's q/k projections, for one, are stored with their rows permuted). A quantized tensor
cannot go through the processor as numbers, so the processor is run on its row indices instead, and the
codes are reordered the same way; a processor that does more than reorder rows gets the tensor
dequantized. Types without a packed form (``gguf_blocks``) are dequantized with the gguf package.

Building the skeleton imports transformers' modeling module for the architecture (1.7 s of a 5 s start
for SmolLM2 on a 2-core EPYC), so the name map is kept in a small JSON file under ``names_cache`` keyed
by everything it depends on (the architecture, the config, the transformers and gguf versions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cache_files import write_text_atomically
from ..light_config import full_config
from .affine import AffineWeight
from .gguf_blocks import unpack
from .gguf_index import TensorEntry, read_gguf_index


def gguf_weights(gguf: Path, config: Any, names_cache: Path | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
    """(HF name, dense float32 tensor or quantized codes) for every tensor the model uses; the GGUF ->
    HF name map is read from (or written to) the folder ``names_cache`` where one is given."""
    index = read_gguf_index(gguf)
    processor, names = _processor_and_names(index.architecture, config, names_cache)
    for tensor in index.tensors:
        codes = unpack(tensor.type_name, tensor.data) if len(tensor.shape) == 2 else None
        order, name = _row_order(processor, tensor.name, codes.shape[0], names) if codes is not None else (None, "")
        if order is not None:
            if name in names:  # most tensors' order is the identity: no copy for them
                yield names[name], codes if np.array_equal(order, np.arange(len(order))) else codes.rows(order)
            continue
        result = processor.process(weights=_dequantized(tensor), name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.array(result.weights, dtype=np.float32))


def _dequantized(tensor: TensorEntry) -> np.ndarray:
    if tensor.type_name in ("F32", "F16"):
        return np.asarray(tensor.data, dtype=np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)


def _processor_and_names(architecture: str, config: Any, names_cache: Path | None = None
                          ) -> tuple[Any, dict[str, str]]:
    """transformers' tensor processor for the file's architecture, and GGUF name -> HF name (from
    ``names_cache`` when it holds them)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    cached = None if names_cache is None else Path(names_cache) / f"gguf-names-{_names_key(architecture, config)}.json"
    if cached is not None and cached.is_file():
        try:
            return processor, json.loads(cached.read_text())
        except (OSError, ValueError):
            pass  # unreadable: built again and rewritten
    names = _names(architecture, config, processor)
    if cached is not None:
        write_text_atomically(cached, json.dumps(names))
    return processor, names


def _names_key(architecture: str, config: Any) -> str:
    import gguf
    import transformers

    parts = (architecture, config.to_json_string(use_diff=False), transformers.__version__,
             getattr(gguf, "__version__", ""))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


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
    return names


def _row_order(processor: Any, name: str, rows: int, names: dict[str, str]) -> tuple[np.ndarray | None, str]:
    """The processor's effect on a tensor's rows as an index array (None if it is not a reordering),
    and the tensor's processed GGUF name."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    result = processor.process(weights=index, name=name, tensor_key_mapping=names,
                               parsed_parameters={"tensors": {}})
    order = np.asarray(result.weights)
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
        return None, result.name
    return order[:, 0].astype(np.int64), result.name
