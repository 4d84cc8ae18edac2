"""The vision-processor contract: what a plugin implements to serve a vision-language model.

A `VisionProcessor` is registered per model architecture (hook ``core_register_vision_processors``;
core.resolve finds it). The engine hands it a rendered prompt and the request's decoded images
(core.media) and gets back `MultiModalInputs`: expanded token ids, placeholder ranges and content hashes;
then, once per request on the vision thread, per-image embeddings. A processor never knows which backend
runs it.

torch and PIL are only named for type checkers here: importing this module imports neither.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

Message = Mapping[str, Any]


class PlaceholderRange(NamedTuple):
    """Where one image sits in the prompt: positions ``start .. start + length - 1``.

    The range spans the image's expanded placeholder; the embedding rows go to the positions inside it
    that hold the image token (all of them except in families such as Idefics3, whose tiles are
    separated by row/column marker tokens).
    """

    start: int
    length: int


@dataclass
class MultiModalInputs:
    """A prompt with its images, ready for a backend.

    :param prompt_token_ids: token ids with image placeholders expanded as the model's own processor
        expands them.
    :param image_token_id: the placeholder token that embedding rows replace.
    :param placeholder_ranges: one range per image, in prompt order.
    :param image_hashes: per-image sha256 of pixel bytes, size and mode: backends fold them into
        prefix-cache keys, so the same image hits the cache and a different one does not.
    :param tensors: the processor's tensors (pixel_values, image_grid_thw, ...) that `encode` consumes.
    :param mrope_positions: Qwen2-VL style 3D positions, shape (3, len(prompt_token_ids)), or None.
    :param mrope_position_delta: for decode, position = seq_len + delta on all three axes.
    :param bidirectional_image_attention: image tokens of one image attend to each other (Gemma 3).
    :param image_embeds: one ``[num_placeholder_tokens, hidden]`` tensor per image, from
        `VisionProcessor.encode`; the engine fills it (once per request) before the backend sees it.
    """

    prompt_token_ids: list[int]
    image_token_id: int
    placeholder_ranges: list[PlaceholderRange] = field(default_factory=list)
    image_hashes: list[str] = field(default_factory=list)
    tensors: dict[str, Any] = field(default_factory=dict)
    mrope_positions: Any | None = None
    mrope_position_delta: int | None = None
    bidirectional_image_attention: bool = False
    image_embeds: list[Any] | None = None

    def embedding_positions(self, image: int) -> list[int]:
        """Prompt positions that receive image `image`'s embedding rows, in row order."""
        start, length = self.placeholder_ranges[image]
        ids = self.prompt_token_ids
        return [p for p in range(start, start + length) if ids[p] == self.image_token_id]


class VisionProcessor(ABC):
    """Turns prompts with images into `MultiModalInputs` and images into embeddings.

    Registered per architecture through ``core_register_vision_processors``; constructed with the
    checkpoint folder. Implementations must be backend-agnostic: `encode` returns plain tensors.
    """

    #: Whether the language model needs `MultiModalInputs.mrope_positions` (Qwen2-VL family).
    uses_mrope: bool = False
    #: Whether image tokens attend to each other bidirectionally (Gemma 3).
    bidirectional_image_attention: bool = False

    @abstractmethod
    def preprocess(self, prompt: str | Sequence[Message], images: Sequence[Image]) -> MultiModalInputs:
        """Expand placeholders and prepare pixel tensors.

        :param prompt: prompt text already holding the model's image placeholders, or chat messages
            whose image parts are ``{"type": "image"}`` (as `core.media.extract_images` leaves them), rendered
            with the model's own chat template.
        :param images: decoded images, in prompt order.
        """

    @abstractmethod
    def encode(self, inputs: MultiModalInputs) -> list[torch.Tensor]:
        """Run the vision encoder and projector: one ``[num_placeholder_tokens, hidden]`` tensor per
        image, ready to replace the image-token embeddings at `inputs.embedding_positions(i)`."""


def image_hash(image: Image) -> str:
    """sha256 of an image's pixel bytes, size and mode: equal images hash equal, whatever the file."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
