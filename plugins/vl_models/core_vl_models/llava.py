"""LLaVA-1.5 (a fixed number of ``<image>`` tokens per image) and LLaVA-NeXT (any-resolution tiles:
the count depends on each image's size, and each image is one contiguous run of ``<image>``)."""

from __future__ import annotations

from typing import Any

from core_vl_models.base import HFVisionProcessor


class LlavaVisionProcessor(HFVisionProcessor):
    """LLaVA-1.5: ``<image>`` expands to (image_size / patch_size)^2 tokens, the same for every image."""

    processor_class = "LlavaProcessor"


class LlavaNextVisionProcessor(HFVisionProcessor):
    """LLaVA-NeXT: base tile plus high-resolution tiles and row-end newlines, one run per image."""

    processor_class = "LlavaNextProcessor"

    def image_token_counts(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[int]:
        return self.counts_from_runs(ids, n_images)
