"""Idefics3 and SmolVLM: an image becomes up to rows x cols tiles plus a global view, each tile a run
of ``<image>`` tokens behind a ``<row_i_col_j>`` marker; the global view (``<global-img>``) ends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.vision import Message
from core_vl_models.base import HFVisionProcessor


class Idefics3VisionProcessor(HFVisionProcessor):
    """Idefics3: an image's tokens are the runs up to and including the one after ``<global-img>``."""

    processor_class = "Idefics3Processor"
    nested_images = True

    def image_token_counts(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[int]:
        global_tag = self.processor.tokenizer.convert_tokens_to_ids("<global-img>")
        counts, current = [], 0
        for position, token in enumerate(ids):
            if token != self.image_token_id:
                continue
            current += 1
            ends_image = position + 1 == len(ids) or ids[position + 1] != self.image_token_id
            if ends_image and self._run_follows(ids, position, global_tag):
                counts.append(current)
                current = 0
        return counts

    def _run_follows(self, ids: list[int], last: int, tag: int) -> bool:
        """Whether the run of image tokens ending at `last` comes right after `tag`."""
        first = last
        while first > 0 and ids[first - 1] == self.image_token_id:
            first -= 1
        return first > 0 and ids[first - 1] == tag


class SmolVLMVisionProcessor(Idefics3VisionProcessor):
    """SmolVLM (2): Idefics3's layout with its own processor."""

    processor_class = "SmolVLMProcessor"

    def render(self, messages: Sequence[Message]) -> str:
        # SmolVLMProcessor.apply_chat_template reads video defaults from the (dropped) video processor;
        # for image-only chats the generic implementation renders the same text.
        from transformers import ProcessorMixin

        return ProcessorMixin.apply_chat_template(
            self.processor, list(messages), tokenize=False, add_generation_prompt=True)
