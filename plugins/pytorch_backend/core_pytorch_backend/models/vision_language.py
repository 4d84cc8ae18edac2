"""Vision-language checkpoints served by their language model.

The backend runs only the text half of a VL checkpoint; the vision tower runs in the vision processor
(core_vl_models), and its embeddings reach the model as ``embed_overrides``. A VL class here builds
the family's text decoder from ``config.text_config`` and loads the language-model tensors, whatever
prefix the checkpoint gives them (``model.language_model.*``, ``language_model.model.*``,
``model.text_model.*``), skipping the vision tower and projector.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .llama import LlamaForCausalLM
from .names import prefix_renamed
from .qwen2 import Qwen2ForCausalLM

# (checkpoint prefix, our prefix), first match wins.
LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),
    ("language_model.", "model."),
)
LANGUAGE_MODEL_ROOTS = ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")


def text_config_of(config: Any) -> Any:
    """The decoder config of a VL config (a copy), with the checkpoint-level tie of the LM head.

    transformers ties embeddings by the top-level ``tie_word_embeddings`` of a composite config, which
    may differ from the text config's own value.
    """
    text = copy.copy(config.get_text_config())
    tie = getattr(config, "tie_word_embeddings", None)
    if tie is not None and text is not config:
        text.tie_word_embeddings = tie
    return text


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors of a VL checkpoint under the text model's names."""
    for name, tensor in weights:
        renamed = prefix_renamed(name, LANGUAGE_MODEL_PREFIXES)
        if renamed.startswith(LANGUAGE_MODEL_ROOTS):
            yield renamed, tensor


class VisionLanguageMixin:
    """Builds the text decoder from the VL config and loads only its weights."""

    #: The text ``model_type`` values this family's decoder class implements.
    text_model_types: tuple[str, ...] = ("llama",)
    #: Not sharded yet: image embeddings and M-RoPE positions untested across ranks (distributed/).
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        text = text_config_of(config)
        text_type = getattr(text, "model_type", None)
        if text_type not in self.text_model_types:
            raise ValueError(f"{type(self).__name__}: a {text_type!r} language model is not supported "
                             f"(supported: {', '.join(self.text_model_types)})")
        super().__init__(text, ops)  # type: ignore[call-arg]
        self.vl_config = config

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        return super().load_weights(language_model_weights(weights))  # type: ignore[misc]


class Qwen2VLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    """Qwen2-VL and Qwen2.5-VL: a Qwen2 decoder with M-RoPE (3D positions from the processor)."""

    uses_mrope = True
    text_model_types = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen2_vl", "qwen2_5_vl")


class LlavaForConditionalGeneration(VisionLanguageMixin, LlamaForCausalLM):
    """LLaVA-1.5 / LLaVA-NeXT (and Idefics3 / SmolVLM, whose text model is Llama too)."""


class InternVLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    """InternVL (transformers-native checkpoints) with a Qwen2 language model."""

    text_model_types = ("qwen2",)

