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


@dataclass(frozen=True)
class ParserRegistration:
    """Where a parser lives and when the server picks it without a flag: the model's architecture is one
    of `architectures` and every string of `chat_template_contains` occurs in its chat template."""

    target: str
    architectures: tuple[str, ...] = ()
    chat_template_contains: tuple[str, ...] = ()


_DEEPSEEK, _DEEPSEEK_CALLS = ("DeepseekV3ForCausalLM",), "<｜tool▁calls▁begin｜>"
_QWEN = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN3_5 = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
            "Qwen3_5MoeForCausalLM")
_LFM2 = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
REASONING_PARSERS: dict[str, ParserRegistration] = {
    # DeepSeek-R1 and its Qwen / Llama distills; their templates write "<｜Assistant｜>" and open <think>.
    "deepseek_r1": ParserRegistration(f"{_PARSERS}.think:DeepSeekR1ReasoningParser",
                                      ("DeepseekV3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"),
                                      ("<｜Assistant｜>", "<think>")),
    # Qwen3.5's template opens <think> in the prompt (closes it when enable_thinking=False), as Qwen3's
    # thinking models do: the prompt tells the parser where the response starts.
    "qwen3": ParserRegistration(f"{_PARSERS}.think:Qwen3ReasoningParser",
                                ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_QWEN3_5), ("<think>",)),
    # GLM-4.5 / 4.6 write <think> themselves, as Qwen3 does (enable_thinking=False: the template closes it).
    "glm45": ParserRegistration(f"{_PARSERS}.think:Qwen3ReasoningParser", ("Glm4MoeForCausalLM",),
                                ("<think>",)),
    # Every gpt-oss checkpoint speaks Harmony; its markers are special tokens (see parsers/harmony.py).
    "openai_gptoss": ParserRegistration(f"{_PARSERS}.harmony:HarmonyReasoningParser",
                                        ("GptOssForCausalLM",)),
    # The next three families' templates ignore enable_thinking (but Nemotron 3 Nano's): their prompt decides.
    # Nemotron-H (Nemotron Nano 2, Nemotron 3 Nano): the template opens <think> in the prompt, or writes
    # <think></think> when thinking is off ("/no_think"; enable_thinking=False for Nemotron 3 Nano).
    "nemotron_v3": ParserRegistration(f"{_PARSERS}.think:PromptThinkReasoningParser", ("NemotronHForCausalLM",),
                                      ("<think>",)),
    # LFM2.5's templates drop past "</think>" reasoning; the model writes <think> itself. LFM2's do not think.
    "lfm2": ParserRegistration(f"{_PARSERS}.think:PromptThinkReasoningParser", _LFM2, ("</think>",)),
    # MiniMax-M1 starts its response with <think> (vLLM's minimax_m1); MiniMax-Text-01 writes none, and its
    # text then passes through. Its template names no <think>, so its turn marker tells it.
    "minimax_m1": ParserRegistration(f"{_PARSERS}.think:PromptThinkReasoningParser", ("MiniMaxForCausalLM",),
                                     ("<beginning_of_sentence>",)),
}
TOOL_CALL_PARSERS: dict[str, ParserRegistration] = {
    "hermes": ParserRegistration(f"{_PARSERS}.hermes:HermesToolCallParser", _QWEN, ("<tool_call>",)),
    # Llama 3.1+ templates write calls as {"name": ..., "parameters": ...}; SmolLM2 (also Llama) does not.
    "llama3_json": ParserRegistration(f"{_PARSERS}.llama3_json:Llama3JsonToolCallParser", ("LlamaForCausalLM",),
                                      ("<|start_header_id|>", '"parameters"')),
    "mistral": ParserRegistration(f"{_PARSERS}.mistral:MistralToolCallParser",
                                  ("MistralForCausalLM", "MixtralForCausalLM"), ("[TOOL_CALLS]",)),
    # Qwen3-Coder shares Qwen3MoeForCausalLM and "<tool_call>" with the general Qwen3 models: by name only
    # there. Qwen3.5 and Nemotron 3 Nano (NemotronHForCausalLM) write its XML calls, as their templates show.
    "qwen3_coder": ParserRegistration(f"{_PARSERS}.qwen3_coder:Qwen3CoderToolCallParser",
                                      (*_QWEN3_5, "NemotronHForCausalLM"), ("<function=",)),
    # Nemotron Nano 2 (NemotronHForCausalLM too) writes a JSON list between <TOOLCALL> tags.
    "nemotron_json": ParserRegistration(f"{_PARSERS}.nemotron:NemotronJsonToolCallParser",
                                        ("NemotronHForCausalLM",), ("<TOOLCALL>",)),
    # Granite 4.0 (-H): Hermes JSON calls in <tool_call> blocks, which some of its tokenizers mark special.
    "granite4": ParserRegistration(f"{_PARSERS}.hermes:Granite4ToolCallParser", ("GraniteMoeHybridForCausalLM",),
                                   ("<tool_call>",)),
    # Every LFM2 / LFM2.5 template lists the tools after "List of tools:"; the model answers with pythonic
    # calls between <|tool_call_start|> and <|tool_call_end|> (llama.cpp's template shows JSON ones).
    "lfm2": ParserRegistration(f"{_PARSERS}.lfm2:Lfm2ToolCallParser", _LFM2, ("List of tools:",)),
    # Jamba and MiniMax both write <tool_calls> blocks: a JSON list (Jamba), JSON objects a line (MiniMax).
    "jamba": ParserRegistration(f"{_PARSERS}.jamba:JambaToolCallParser", ("JambaForCausalLM",),
                                ("<tool_calls>",)),
    "minimax": ParserRegistration(f"{_PARSERS}.minimax:MiniMaxToolCallParser", ("MiniMaxForCausalLM",),
                                  ("<tool_calls>",)),
    "openai": ParserRegistration(f"{_PARSERS}.harmony:HarmonyToolCallParser", ("GptOssForCausalLM",)),
    # DeepseekV3ForCausalLM serves DeepSeek V3 / R1 (arguments in ```json fences), V3.1 (NAME<｜tool▁sep｜>
    # arguments, as its template's source writes them) and Kimi K2: their templates tell them apart.
    "deepseek_v3": ParserRegistration(f"{_PARSERS}.deepseek:DeepSeekV3ToolCallParser", _DEEPSEEK,
                                      (_DEEPSEEK_CALLS, "```json")),
    "deepseek_v31": ParserRegistration(f"{_PARSERS}.deepseek:DeepSeekV31ToolCallParser", _DEEPSEEK,
                                       (_DEEPSEEK_CALLS, "<｜tool▁sep｜>' + tool['function']['arguments']")),
    "kimi_k2": ParserRegistration(f"{_PARSERS}.kimi_k2:KimiK2ToolCallParser", _DEEPSEEK,
                                  ("<|tool_calls_section_begin|>",)),
    "glm45": ParserRegistration(f"{_PARSERS}.glm45:Glm45ToolCallParser", ("Glm4MoeForCausalLM",),
                                ("<arg_key>",)),
    # Llama 4's own template writes JSON calls; a pythonic template (vLLM's) shows the list format.
    "pythonic": ParserRegistration(f"{_PARSERS}.pythonic:PythonicToolCallParser", ("Llama4ForCausalLM",),
                                   ("[func_name1(",)),
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
    _register_parsers(register, REASONING_PARSERS)


@hookimpl
def core_register_tool_call_parsers(register: Register) -> None:
    _register_parsers(register, TOOL_CALL_PARSERS)


def _register_parsers(register: Register, parsers: dict[str, ParserRegistration]) -> None:
    for name, parser in parsers.items():
        register(name, parser.target, architectures=parser.architectures,
                 chat_template_contains=parser.chat_template_contains)
