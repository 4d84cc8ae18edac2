"""Where a GGUF file's tensors are, read straight from its header, their bytes memory-mapped.

The gguf package's reader builds a numpy view for every metadata value, including each of a
tokenizer's ~100,000 vocabulary strings, which takes seconds; loading weights needs only the tensor
table and two metadata values. This walks the header with ``struct`` (format: the GGUF spec, v2 and v3),
skipping values it does not need.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar (8: string, 9: array are handled apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: ``data`` is uint8 [rows, bytes per row] for block-quantized types, and
    the array in its own dtype and shape (numpy order) for float types."""

    name: str
    type_name: str  # GGMLQuantizationType name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # numpy order: rows first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    tensors: list[TensorEntry]
    metadata: dict[str, Any]  # scalar and string values by key (an array's value is None)


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.pos = buffer, 0

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.read("Q")
        text = bytes(self.buffer[self.pos : self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def skip_strings(self, count: int) -> None:
        buffer, pos, length = self.buffer, self.pos, struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + length(buffer, pos)[0]
        self.pos = pos

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.read("I"), self.read("Q")
            if item in SCALARS:  # skipped as a block: nothing here needs array values
                self.pos += struct.calcsize("<" + SCALARS[item]) * count
            elif item == STRING:  # a vocabulary: each string's length read, its bytes skipped
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.read(SCALARS[kind])


def _read_metadata(mapped: np.memmap, path: Path) -> tuple[dict[str, Any], _Cursor, int]:
    """(metadata, the cursor at the tensor table, the number of tensors)."""
    cursor = _Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.pos = 4
    version, n_tensors, n_kv = cursor.read("I"), cursor.read("Q"), cursor.read("Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.read("I"))
    return metadata, cursor, n_tensors


def read_gguf_index(path: Path) -> GGUFIndex:
    """The architecture, tensor table and metadata of the GGUF file at ``path``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    metadata, cursor, n_tensors = _read_metadata(mapped, path)
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.read("Q") for _ in range(cursor.read("I"))]
        infos.append((name, dims, GGMLQuantizationType(cursor.read("I")), cursor.read("Q")))
    alignment = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
    start = -(-cursor.pos // alignment) * alignment
    tensors = [_entry(mapped, start, info, GGML_QUANT_SIZES) for info in infos]
    return GGUFIndex(str(metadata.get("general.architecture", "")), tensors, metadata)


def _entry(mapped: np.memmap, start: int, info, quant_sizes) -> TensorEntry:
    name, dims, qtype, offset = info
    shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
    block, block_bytes = quant_sizes[qtype]
    row_bytes = dims[0] // block * block_bytes
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
    if qtype.name in ("F32", "F16"):
        data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(shape)
    else:
        data = raw
    return TensorEntry(name, qtype.name, shape, data)
