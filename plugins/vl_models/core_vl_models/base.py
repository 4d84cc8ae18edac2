"""The machinery every family shares: transformers' processor for preprocessing, transformers' vision
modules with the checkpoint's weights for encoding.

A family module subclasses `HFVisionProcessor` and sets the processor class name, and overrides at most
how tokens group into images (`image_token_counts`) and the position information its language model
needs (`position_info`). Nothing here knows which backend consumes the embeddings.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import types
from collections.abc import Sequence
from typing import Any

import torch

from core.errors import InvalidRequestError
from core.vision import Message, MultiModalInputs, PlaceholderRange, VisionProcessor, image_hash

# Processor outputs that describe the text, not the images.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask"})


def without_video(processor_class: type) -> type:
    """`processor_class` with its video processor dropped.

    Without torchvision, transformers cannot even type-check a video processor argument, so processors
    that own one (Qwen2-VL, SmolVLM, InternVL) fail to build; images never need it.
    """

    class ImageOnly(processor_class):  # type: ignore[misc, valid-type]
        __init__ = _video_argument_optional(processor_class.__init__)

        @classmethod
        def get_attributes(cls) -> list[str]:
            return [a for a in processor_class.get_attributes() if "video" not in a]

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def _video_argument_optional(init: Any) -> Any:
    """`init` with ``video_processor`` defaulting to None (SmolVLM requires it positionally).

    A copy of the function, not a wrapper: transformers routes saved options by the constructor's
    own argument names (``__code__.co_varnames``).
    """
    code = init.__code__
    names = code.co_varnames[1:code.co_argcount]
    defaults = init.__defaults__ or ()
    first_default = len(names) - len(defaults)
    if "video_processor" not in names or names.index("video_processor") >= first_default:
        return init
    defaults = (None,) * (first_default - names.index("video_processor")) + defaults
    copy = types.FunctionType(code, init.__globals__, init.__name__, defaults, init.__closure__)
    copy.__kwdefaults__ = init.__kwdefaults__
    return copy


class HFVisionProcessor(VisionProcessor):
    """A VisionProcessor over a Hugging Face checkpoint folder.

    :param model_path: the checkpoint folder (config.json, weights, processor files).
    :param dtype: the vision tower's dtype; "auto" keeps the checkpoint's.
    :param device: where the vision tower runs.
    """

    #: transformers' processor class for this family.
    processor_class: str = ""
    #: Whether the processor wants images nested per prompt (``[[img, img]]``).
    nested_images: bool = False

    def __init__(self, model_path: str, *, dtype: str | torch.dtype = "auto", device: str = "cpu") -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            self.config: dict[str, Any] = json.load(f)
        self.architecture = (self.config.get("architectures") or [type(self).__name__])[0]

    # -- preprocessing ---------------------------------------------------------------------------------

    @functools.cached_property
    def processor(self) -> Any:
        """transformers' own processor for the checkpoint, without its video half."""
        import transformers

        return without_video(getattr(transformers, self.processor_class)).from_pretrained(self.model_path)

    @functools.cached_property
    def image_token_id(self) -> int:
        """The token whose embeddings the image features replace (as the model's config names it)."""
        token_id = self.config.get("image_token_id", self.config.get("image_token_index"))
        if token_id is None:
            token_id = self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        return int(token_id)

    def render(self, messages: Sequence[Message]) -> str:
        """Chat messages (image parts as ``{"type": "image"}``) -> prompt text, by the model's template."""
        return self.processor.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def preprocess(self, prompt: str | Sequence[Message], images: Sequence[Any]) -> MultiModalInputs:
        text = prompt if isinstance(prompt, str) else self.render(prompt)
        images = list(images)
        batch_images = ([images] if self.nested_images else images) if images else None
        try:
            out = self.processor(text=[text], images=batch_images, return_tensors="pt")
        except ValueError as exc:  # e.g. two image placeholders for one image
            raise InvalidRequestError(f"the prompt and its images do not match: {exc}", param="messages") from exc
        ids = [int(t) for t in out["input_ids"][0]]
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        inputs = MultiModalInputs(
            prompt_token_ids=ids,
            image_token_id=self.image_token_id,
            image_hashes=[image_hash(image) for image in images],
            tensors=tensors,
            bidirectional_image_attention=self.bidirectional_image_attention,
        )
        inputs.placeholder_ranges = self.placeholder_ranges(ids, tensors, len(images))
        self.position_info(inputs)
        return inputs

    def placeholder_ranges(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[PlaceholderRange]:
        """One range per image, from the first to the last of its image tokens."""
        positions = [p for p, t in enumerate(ids) if t == self.image_token_id]
        counts = self.image_token_counts(ids, tensors, n_images) if n_images else []
        if sum(counts) != len(positions):
            raise InvalidRequestError(
                f"the prompt has {len(positions)} image tokens but its {n_images} image(s) need {sum(counts)}; "
                "give one image placeholder per image", param="messages")
        ranges, start = [], 0
        for count in counts:
            first, last = positions[start], positions[start + count - 1]
            ranges.append(PlaceholderRange(first, last - first + 1))
            start += count
        return ranges

    def image_token_counts(self, ids: list[int], tensors: dict[str, Any], n_images: int) -> list[int]:
        """Image tokens per image. Default: images all expand alike (fixed-size families)."""
        total = sum(1 for t in ids if t == self.image_token_id)
        return [total // n_images] * n_images

    def counts_from_runs(self, ids: list[int], n_images: int) -> list[int]:
        """Image tokens per image for families that expand each image into one contiguous run."""
        runs = token_runs(ids, self.image_token_id)
        if len(runs) != n_images:
            raise InvalidRequestError(
                f"{n_images} image(s) but {len(runs)} separate image placeholder(s): separate adjacent "
                "images with text", param="messages")
        return runs

    def position_info(self, inputs: MultiModalInputs) -> None:
        """Fill position information the language model needs (M-RoPE); nothing by default."""

    # -- encoding --------------------------------------------------------------------------------------

    @functools.cached_property
    def model(self) -> Any:
        """The checkpoint's model with its text half dropped: only the vision side stays in memory."""
        import transformers

        model_class = getattr(transformers, self.architecture)
        model = model_class.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
        inner = model.model
        inner.language_model = None
        model.lm_head = None
        return model

    def encode(self, inputs: MultiModalInputs) -> list[torch.Tensor]:
        if not inputs.placeholder_ranges:
            return []
        with torch.inference_mode():
            features = self.image_features(inputs.tensors)
        flat = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        counts = [len(inputs.embedding_positions(i)) for i in range(len(inputs.placeholder_ranges))]
        if flat.shape[0] != sum(counts):
            raise RuntimeError(f"the vision tower produced {flat.shape[0]} rows for {sum(counts)} image tokens")
        return list(torch.split(flat, counts))

    def image_features(self, tensors: dict[str, Any]) -> list[torch.Tensor]:
        """The projected image features, in prompt order (any leading shape; rows are flattened)."""
        get_features = self.model.model.get_image_features
        accepted = inspect.signature(get_features).parameters
        kwargs = {k: self._to_device(v) for k, v in tensors.items() if k in accepted}
        out = get_features(**kwargs)
        features = getattr(out, "pooler_output", out)
        return list(features) if isinstance(features, (list, tuple)) else [features]

    def _to_device(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point():
            return value.to(self.device, dtype=self.model.dtype)
        return value.to(self.device)


def token_runs(ids: list[int], token_id: int) -> list[int]:
    """Lengths of the maximal runs of `token_id` in `ids`."""
    runs: list[int] = []
    previous = None
    for token in ids:
        if token == token_id:
            if previous == token_id:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    return runs
