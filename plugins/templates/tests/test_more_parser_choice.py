"""Automatic parser choice for gpt-oss, DeepSeek V3 / V3.1 / R1, Kimi K2, GLM-4.5 / 4.6 and Llama 4, against
their published chat templates (copied into data/; data/SOURCES.md names each source). Three families share
DeepseekV3ForCausalLM, so their templates must tell them apart, and no template may fit two parsers of one
architecture (then nothing would be chosen)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.plugins import PluginHost
from core.resolve import parser_entry
from core_templates.plugin import REASONING_PARSERS, TOOL_CALL_PARSERS, ParserRegistration, builtin_source

DATA = Path(__file__).parent / "data"
NEW = ("gpt_oss", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm46", "llama4_pythonic")
TEMPLATES = {name: (DATA / f"{name}.jinja").read_text(encoding="utf-8") for name in NEW} | {
    "deepseek_r1": (DATA / "deepseek_r1.jinja").read_text(encoding="utf-8"),  # R1's call format, as V3's
    "llama3": builtin_source("llama3"),
}

# (architecture, template) -> (reasoning parser, tool-call parser)
CASES = {
    ("GptOssForCausalLM", "gpt_oss"): ("openai_gptoss", "openai"),
    ("DeepseekV3ForCausalLM", "deepseek_v3"): (None, "deepseek_v3"),
    ("DeepseekV3ForCausalLM", "deepseek_r1"): ("deepseek_r1", "deepseek_v3"),
    ("DeepseekV3ForCausalLM", "deepseek_v31"): ("deepseek_r1", "deepseek_v31"),
    ("DeepseekV3ForCausalLM", "kimi_k2"): (None, "kimi_k2"),
    ("Glm4MoeForCausalLM", "glm46"): ("glm45", "glm45"),
    ("Llama4ForCausalLM", "llama4_pythonic"): (None, "pythonic"),
    ("Llama4ForCausalLM", "llama3"): (None, None),  # a template of JSON calls (as Llama 4's own) is not pythonic
    ("LlamaForCausalLM", "llama4_pythonic"): (None, None),  # pythonic Llama 3.2: by name only
}


def _names(host: PluginHost, architecture: str, source: str) -> tuple[str | None, str | None]:
    reasoning = parser_entry(host.reasoning_parsers, None, "--reasoning-parser", architecture, source)
    tools = parser_entry(host.tool_call_parsers, None, "--tool-call-parser", architecture, source)
    return (reasoning.name if reasoning else None, tools.name if tools else None)


@pytest.mark.parametrize(("architecture", "template"), sorted(CASES), ids=lambda v: str(v))
def test_automatic_choice(host: PluginHost, architecture: str, template: str) -> None:
    assert _names(host, architecture, TEMPLATES[template]) == CASES[architecture, template]


@pytest.mark.parametrize("table", [REASONING_PARSERS, TOOL_CALL_PARSERS], ids=["reasoning", "tools"])
def test_no_template_fits_two_parsers_of_one_architecture(
        table: dict[str, ParserRegistration], templates: dict[str, tuple[str, str | None, str | None]]) -> None:
    sources = {**TEMPLATES, **{name: value[0] for name, value in templates.items()}}
    architectures = {a for registration in table.values() for a in registration.architectures}
    for (name, source), architecture in ((s, a) for s in sources.items() for a in sorted(architectures)):
        fitting = [parser for parser, registration in table.items() if architecture in registration.architectures
                   and all(marker in source for marker in registration.chat_template_contains)]
        assert len(fitting) <= 1, (name, architecture, fitting)


@pytest.mark.parametrize("name", ["openai", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "pythonic"])
def test_each_tool_call_parser_by_name(host: PluginHost, name: str) -> None:
    entry = parser_entry(host.tool_call_parsers, name, "--tool-call-parser", "LlamaForCausalLM", "")
    assert entry is not None and entry.name == name


@pytest.mark.parametrize("name", ["openai_gptoss", "glm45"])
def test_each_reasoning_parser_by_name(host: PluginHost, name: str) -> None:
    entry = parser_entry(host.reasoning_parsers, name, "--reasoning-parser", "LlamaForCausalLM", "")
    assert entry is not None and entry.name == name
