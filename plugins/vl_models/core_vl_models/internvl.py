"""InternVL (the transformers-native checkpoints): ``<img><IMG_CONTEXT>*N</img>`` per image, where N is
image_seq_length times the number of tiles the image was cut into (plus a thumbnail)."""

from __future__ import annotations

from typing import Any

from core_vl_models.base import HFVisionProcessor


class InternVLVisionProcessor(HFVisionProcessor):
    """InternVL: one contiguous run of context tokens per image, of a size that depends on the image."""

    processor_class = "InternVLProcessor"

    def image_token_counts(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[int]:
        return self.counts_from_runs(ids, n_images)
