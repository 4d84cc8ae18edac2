"""A GGUF file's tensors under Hugging Face names, quantized ones kept as ``AffineWeight`` codes.

Names come from transformers' own GGUF mapping (``get_gguf_hf_weights_map`` over a meta-device skeleton
of the model) and each tensor goes through transformers' per-architecture tensor processor, as its GGUF
loader does (Llama's q/k projections, for one, are stored with their rows permuted). A quantized tensor
cannot go through the processor as numbers, so the processor is run on its row indices instead, and the
codes are reordered the same way; a processor that does more than reorder rows gets the tensor
dequantized. Types without a packed form (``gguf_blocks``) are dequantized with the gguf package.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .affine import AffineWeight
from .gguf_blocks import unpack


def gguf_weights(gguf: Path, config: Any) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
    """(HF name, dense float32 tensor or quantized codes) for every tensor the model uses."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf))
    processor, names = _processor_and_names(reader, config)
    for tensor in reader.tensors:
        codes = unpack(tensor.tensor_type.name, tensor.data) if tensor.data.ndim == 2 else None
        order, name = _row_order(processor, tensor.name, codes.shape[0], names) if codes is not None else (None, "")
        if order is not None:
            if name in names:
                yield names[name], codes.rows(order)
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"tensors": {}})
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.array(result.weights, dtype=np.float32))


def _processor_and_names(reader: Any, config: Any) -> tuple[Any, dict[str, str]]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return processor, get_gguf_hf_weights_map(skeleton, processor)


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
