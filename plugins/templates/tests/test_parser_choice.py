"""Automatic parser choice: the templates plugin's registration metadata against real chat templates.

Each case is a model family as it ships (architecture + chat template); the expected parsers are the ones
its model card documents. A family sharing an architecture with another (SmolLM2 and Llama 3 are both
LlamaForCausalLM) is told apart by its template.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import PluginError
from core.plugins import PluginHost
from core.resolve import parser_entry

# (architecture, template name in the conftest's TEMPLATES) -> (reasoning parser, tool-call parser)
CASES = {
    ("Qwen2ForCausalLM", "qwen2.5"): (None, "hermes"),
    ("Qwen3ForCausalLM", "qwen3"): ("qwen3", "hermes"),
    ("Qwen3MoeForCausalLM", "qwen3"): ("qwen3", "hermes"),
    ("Qwen2ForCausalLM", "chatml"): (None, "hermes"),  # a Qwen2 checkpoint with no template: the built-in
    ("Qwen2ForCausalLM", "deepseek_r1"): ("deepseek_r1", None),  # DeepSeek-R1-Distill-Qwen
    ("LlamaForCausalLM", "llama3"): (None, "llama3_json"),
    ("LlamaForCausalLM", "smollm2"): (None, None),
    ("MistralForCausalLM", "mistral"): (None, "mistral"),
    ("GemmaForCausalLM", "gemma"): (None, None),
}


def _names(host: PluginHost, architecture: str, source: str) -> tuple[str | None, str | None]:
    reasoning = parser_entry(host.reasoning_parsers, None, "--reasoning-parser", architecture, source)
    tools = parser_entry(host.tool_call_parsers, None, "--tool-call-parser", architecture, source)
    return (reasoning.name if reasoning else None, tools.name if tools else None)


@pytest.mark.parametrize(("architecture", "template"), sorted(CASES), ids=lambda v: str(v))
def test_automatic_choice(host: PluginHost, templates: dict[str, Any], architecture: str, template: str) -> None:
    assert _names(host, architecture, templates[template][0]) == CASES[architecture, template]


def test_none_turns_the_automatic_choice_off(host: PluginHost, templates: dict[str, Any]) -> None:
    source = templates["qwen3"][0]
    assert parser_entry(host.reasoning_parsers, "none", "--reasoning-parser", "Qwen3ForCausalLM", source) is None
    assert parser_entry(host.tool_call_parsers, "none", "--tool-call-parser", "Qwen3ForCausalLM", source) is None


def test_a_named_parser_wins_over_the_architecture(host: PluginHost) -> None:
    entry = parser_entry(host.tool_call_parsers, "mistral", "--tool-call-parser", "Qwen2ForCausalLM", "")
    assert entry is not None and entry.name == "mistral"


def test_unknown_name_lists_the_registered_parsers(host: PluginHost) -> None:
    with pytest.raises(PluginError) as raised:
        parser_entry(host.tool_call_parsers, "hermes2", "--tool-call-parser", "Qwen2ForCausalLM", "")
    message = str(raised.value)
    assert "--tool-call-parser 'hermes2'" in message and "\n" not in message
    for name in ("hermes", "llama3_json", "mistral", "qwen3_coder", "'none'"):
        assert name in message


def test_two_fitting_parsers_mean_no_automatic_choice(host: PluginHost) -> None:
    class Rival:
        from core import hookimpl

        @hookimpl
        def core_register_tool_call_parsers(self, register: Any) -> None:
            register("rival", "core_templates.parsers.hermes:HermesToolCallParser",
                     architectures=("Qwen2ForCausalLM",), chat_template_contains=("<tool_call>",))

    host.register(Rival(), name="rival")
    try:
        assert _names(host, "Qwen2ForCausalLM", "... <tool_call> ...")[1] is None
        assert _names(host, "Qwen3ForCausalLM", "... <tool_call> ...")[1] == "hermes"
    finally:
        host.unregister("rival")
