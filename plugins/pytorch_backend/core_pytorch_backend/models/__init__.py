"""Built-in model architectures, by HF architecture name, as lazy "module:Class" strings."""

from __future__ import annotations

import importlib

BUILTIN_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "core_pytorch_backend.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "core_pytorch_backend.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "core_pytorch_backend.models.qwen3:Qwen3ForCausalLM",
    "MistralForCausalLM": "core_pytorch_backend.models.mistral:MistralForCausalLM",
}


def resolve_class(target: str | type) -> type:
    """A model class, given the class itself or a ``"module:Class"`` string."""
    if isinstance(target, type):
        return target
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise ValueError(f"expected 'module:Class', got {target!r}")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["BUILTIN_ARCHITECTURES", "resolve_class"]
