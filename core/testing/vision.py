"""Helpers for tests of vision processors: the engine and the backends never call them.

`prepare_chat` runs the intake a request's images get (extract, load, preprocess) in one call;
`merge_image_embeddings` scatters embeddings the way a language model's embedding layer receives them;
`decode_position` is the rotary position of a generated token (M-RoPE's delta applied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.media import MediaPolicy, Message, extract_images, load_images
from core.vision import MultiModalInputs, VisionProcessor

if TYPE_CHECKING:
    import torch


def prepare_chat(processor: VisionProcessor, messages: Sequence[Message], policy: MediaPolicy) -> MultiModalInputs:
    """Chat messages with image parts -> MultiModalInputs: extract, load under `policy`, preprocess."""
    rendered, sources = extract_images(messages)
    return processor.preprocess(rendered, load_images(sources, policy))


def merge_image_embeddings(
    inputs_embeds: torch.Tensor, inputs: MultiModalInputs, image_embeds: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Scatter per-image embeddings into a prompt's ``[seq_len, hidden]`` token embeddings (a copy)."""
    import torch

    merged = inputs_embeds.clone()
    for i, embeds in enumerate(image_embeds):
        positions = torch.tensor(inputs.embedding_positions(i), device=merged.device)
        if len(positions) != embeds.shape[0]:
            raise ValueError(f"image {i} has {embeds.shape[0]} embedding rows for {len(positions)} placeholders")
        merged[positions] = embeds.to(merged.dtype)
    return merged


def decode_position(inputs: MultiModalInputs, position: int) -> int:
    """The rotary position of the token at sequence index `position` (>= prompt length)."""
    return position + (inputs.mrope_position_delta or 0)
