"""Qwen2-VL and Qwen2.5-VL: image tokens per image from ``image_grid_thw``; 3D M-RoPE positions."""

from __future__ import annotations

from typing import Any

import torch

from core.vision import MultiModalInputs
from core_vl_models.base import HFVisionProcessor


class Qwen2VLVisionProcessor(HFVisionProcessor):
    """Qwen2-VL: ``<|vision_start|><|image_pad|>*N<|vision_end|>``, N = t*h*w / merge^2."""

    processor_class = "Qwen2VLProcessor"
    uses_mrope = True

    @property
    def merge_size(self) -> int:
        return int(self.config["vision_config"].get("spatial_merge_size", 2))

    def image_token_counts(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[int]:
        grid = tensors["image_grid_thw"]
        return [int(n) for n in (grid.prod(-1) // self.merge_size**2)]

    def position_info(self, inputs: MultiModalInputs) -> None:
        positions, delta = mrope_positions(
            len(inputs.prompt_token_ids), inputs.placeholder_ranges,
            inputs.tensors.get("image_grid_thw"), self.merge_size)
        inputs.mrope_positions, inputs.mrope_position_delta = positions, delta


def mrope_positions(length: int, ranges: list, grid_thw: torch.Tensor | None,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """(3, length) temporal/height/width positions and the decode delta, as Qwen2-VL's get_rope_index.

    Text advances all three axes together; an image's tokens take (t, row, column) offsets from the
    position where it starts, and text resumes after the larger of its merged height and width.
    """
    chunks, pos, cursor = [], 0, 0
    for i, (start, span) in enumerate(ranges):
        chunks.append(torch.arange(start - cursor).expand(3, -1) + pos)
        pos += start - cursor
        t, h, w = (int(x) for x in grid_thw[i])
        h, w = h // merge_size, w // merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        chunks.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = start + span
    chunks.append(torch.arange(length - cursor).expand(3, -1) + pos)
    positions = torch.cat(chunks, dim=1)
    return positions, int(positions.max()) + 1 - length


class Qwen2_5_VLVisionProcessor(Qwen2VLVisionProcessor):
    """Qwen2.5-VL: the same placeholders and positions for images (time spacing only affects video)."""

    processor_class = "Qwen2_5_VLProcessor"
