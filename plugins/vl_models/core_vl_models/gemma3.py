"""Gemma 3: ``<start_of_image>`` expands to ``<start_of_image><image_soft_token>*mm_tokens_per_image
<end_of_image>``; the soft tokens of one image attend to each other bidirectionally."""

from __future__ import annotations

from core_vl_models.base import HFVisionProcessor


class Gemma3VisionProcessor(HFVisionProcessor):
    """Gemma 3: a fixed token count per image; bidirectional attention inside each image."""

    processor_class = "Gemma3Processor"
    nested_images = True
    bidirectional_image_attention = True
