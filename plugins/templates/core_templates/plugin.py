"""Hook implementations of the templates plugin; registration imports nothing heavier than this module."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

from core import hookimpl
from core.hookspecs import Register

# Built-in template name -> the architectures that use it when a checkpoint ships no template.
# No architecture appears twice, so the choice never depends on registration order.
BUILTIN_TEMPLATES: dict[str, tuple[str, ...]] = {
    "chatml": ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
    "llama3": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM", "MixtralForCausalLM"),
    "gemma": ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    "completion": (),
}

_PARSERS = "core_templates.parsers"
REASONING_PARSERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "deepseek_r1": (f"{_PARSERS}.think:DeepSeekR1ReasoningParser", ("DeepseekV3ForCausalLM",)),
    "qwen3": (f"{_PARSERS}.think:Qwen3ReasoningParser", ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
}
TOOL_CALL_PARSERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hermes": (f"{_PARSERS}.hermes:HermesToolCallParser",
               ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
    "llama3_json": (f"{_PARSERS}.llama3_json:Llama3JsonToolCallParser", ("LlamaForCausalLM",)),
    "mistral": (f"{_PARSERS}.mistral:MistralToolCallParser", ("MistralForCausalLM", "MixtralForCausalLM")),
    # Qwen3-Coder shares Qwen3MoeForCausalLM with the general Qwen3 models: chosen by name only.
    "qwen3_coder": (f"{_PARSERS}.qwen3_coder:Qwen3CoderToolCallParser", ()),
}


def builtin_source(name: str) -> str:
    """The Jinja source of built-in template `name` (shipped as core_templates/builtin/NAME.jinja)."""
    return (resources.files("core_templates") / "builtin" / f"{name}.jinja").read_text(encoding="utf-8")


@dataclass(frozen=True)
class BuiltinTemplate:
    """Factory of a built-in template: reads and compiles its source only when first used."""

    name: str

    def __call__(self, tokenizer: Any) -> Any:
        from core_templates.jinja_template import JinjaChatTemplate

        return JinjaChatTemplate(builtin_source(self.name), tokenizer)


@hookimpl
def core_register_chat_templates(register: Register) -> None:
    for name, architectures in BUILTIN_TEMPLATES.items():
        register(name, BuiltinTemplate(name), architectures=architectures)


@hookimpl
def core_make_chat_template(source: str, tokenizer: Any) -> Any:
    import jinja2

    from core.errors import PluginError
    from core_templates.jinja_template import JinjaChatTemplate

    try:
        return JinjaChatTemplate(source, tokenizer)
    except jinja2.TemplateSyntaxError as exc:
        raise PluginError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc


@hookimpl
def core_register_reasoning_parsers(register: Register) -> None:
    for name, (target, architectures) in REASONING_PARSERS.items():
        register(name, target, architectures=architectures)


@hookimpl
def core_register_tool_call_parsers(register: Register) -> None:
    for name, (target, architectures) in TOOL_CALL_PARSERS.items():
        register(name, target, architectures=architectures)
