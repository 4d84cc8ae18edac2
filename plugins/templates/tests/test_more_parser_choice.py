"""Automatic parser choice for gpt-oss, DeepSeek V3 / V3.1 / R1, Kimi K2, GLM-4.5 / 4.6, Llama 4 and the hybrid
families (Qwen3.5, Nemotron-H, Granite 4.0-H, LFM2 / LFM2.5, Jamba, MiniMax-M1), against their published chat
templates (copied into data/; data/SOURCES.md names each source). Families sharing an architecture
(DeepseekV3ForCausalLM; NemotronHForCausalLM) must be told apart by their templates, and no template may fit
two parsers of one architecture (then nothing would be chosen). Each chosen tool-call parser must read back
the calls its own template writes into a conversation."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.parsers import ParseContext
from core.plugins import PluginHost
from core.resolve import parser_entry
from core_templates.jinja_template import JinjaChatTemplate
from core_templates.plugin import REASONING_PARSERS, TOOL_CALL_PARSERS, ParserRegistration, builtin_source

DATA = Path(__file__).parent / "data"
HYBRID = ("qwen3_5", "nemotron_nano_v2", "nemotron3_nano", "granite4", "lfm2_8b_a1b", "lfm2_5", "lfm2_5_8b_a1b",
          "jamba_mini_1_7", "minimax_m1")
NEW = ("gpt_oss", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm46", "llama4_pythonic", *HYBRID)
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
    # Qwen3.5 (dense and MoE, with and without vision): Qwen3-Coder's XML calls; <think> opened in the prompt
    **{(architecture, "qwen3_5"): ("qwen3", "qwen3_coder") for architecture in (
        "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM")},
    # Nemotron-H: Nemotron Nano 2 writes <TOOLCALL>[JSON]; Nemotron 3 Nano writes Qwen3-Coder's XML calls
    ("NemotronHForCausalLM", "nemotron_nano_v2"): ("nemotron_v3", "nemotron_json"),
    ("NemotronHForCausalLM", "nemotron3_nano"): ("nemotron_v3", "qwen3_coder"),
    ("GraniteMoeHybridForCausalLM", "granite4"): (None, "granite4"),
    # LFM2 (no reasoning), LFM2.5 (drops past "</think>" reasoning), dense and MoE
    ("Lfm2MoeForCausalLM", "lfm2_8b_a1b"): (None, "lfm2"),
    ("Lfm2ForCausalLM", "lfm2_8b_a1b"): (None, "lfm2"),
    ("Lfm2ForCausalLM", "lfm2_5"): ("lfm2", "lfm2"),
    ("Lfm2MoeForCausalLM", "lfm2_5_8b_a1b"): ("lfm2", "lfm2"),
    ("JambaForCausalLM", "jamba_mini_1_7"): (None, "jamba"),
    ("MiniMaxForCausalLM", "minimax_m1"): ("minimax_m1", "minimax"),
    # the markers alone choose nothing for another architecture
    ("Qwen2ForCausalLM", "nemotron_nano_v2"): (None, None),
    ("LlamaForCausalLM", "minimax_m1"): (None, None),
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


@pytest.mark.parametrize("name", ["openai", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "pythonic",
                                  "qwen3_coder", "nemotron_json", "granite4", "lfm2", "jamba", "minimax"])
def test_each_tool_call_parser_by_name(host: PluginHost, name: str) -> None:
    entry = parser_entry(host.tool_call_parsers, name, "--tool-call-parser", "LlamaForCausalLM", "")
    assert entry is not None and entry.name == name


@pytest.mark.parametrize("name", ["openai_gptoss", "glm45", "nemotron_v3", "lfm2", "minimax_m1"])
def test_each_reasoning_parser_by_name(host: PluginHost, name: str) -> None:
    entry = parser_entry(host.reasoning_parsers, name, "--reasoning-parser", "LlamaForCausalLM", "")
    assert entry is not None and entry.name == name


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
QUESTION, RESULT = "What is the weather in Paris?", "Sunny, 24 degrees."
CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": RESULT},
]
# The hybrid cases whose template writes an assistant's past tool calls (LFM2's and LFM2.5-1.2B's templates
# write the message's content only, so the model's own text is all there is).
ROUND_TRIPS = sorted(case for case in CASES if case[1] in HYBRID and case[1] not in ("lfm2_8b_a1b", "lfm2_5")
                     and CASES[case][1] is not None)


@pytest.mark.parametrize(("architecture", "template"), ROUND_TRIPS, ids=lambda v: str(v))
def test_the_chosen_parser_reads_the_calls_its_template_writes(host: PluginHost, architecture: str,
                                                               template: str) -> None:
    rendered = JinjaChatTemplate(TEMPLATES[template]).render(CONVERSATION, tools=TOOLS)
    turn = rendered[rendered.index(QUESTION) + len(QUESTION):rendered.index(RESULT)]  # the assistant's turn
    entry = parser_entry(host.tool_call_parsers, None, "--tool-call-parser", architecture, TEMPLATES[template])
    assert entry is not None
    parser = entry.load()(None).start(ParseContext(tools=TOOLS))
    calls = parser.parse(turn).tool_calls
    assert [(c.name, c.input()) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})], turn
    # their tags are (or may be) special tokens: the server must decode the response with them kept
    assert parser.reads_special_tokens is (entry.name in ("lfm2", "jamba", "nemotron_json", "granite4"))


THINKING_CASES = sorted(case for case in CASES if case[1] in HYBRID and CASES[case][0] is not None)


@pytest.mark.parametrize(("architecture", "template"), THINKING_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}], ids=["default", "thinking"])
def test_the_chosen_reasoning_parser_follows_the_rendered_prompt(host: PluginHost, architecture: str, template: str,
                                                                 kwargs: dict[str, bool]) -> None:
    prompt = JinjaChatTemplate(TEMPLATES[template]).render([{"role": "user", "content": "Hi"}], **kwargs)
    opened = prompt.rstrip().endswith("<think>")  # Qwen3.5 and Nemotron-H open it; the others let the model
    text = "Hm.\n</think>\n\nSunny." if opened else "<think>\nHm.\n</think>\n\nSunny."
    entry = parser_entry(host.reasoning_parsers, None, "--reasoning-parser", architecture, TEMPLATES[template])
    assert entry is not None
    parser = entry.load()(None).start(ParseContext(prompt, chat_template_kwargs=kwargs))
    assert parser.split(text) == ("Hm.", "Sunny.")


@pytest.mark.parametrize(("architecture", "template"), [
    ("NemotronHForCausalLM", "nemotron_nano_v2"), ("Lfm2ForCausalLM", "lfm2_5"), ("Lfm2MoeForCausalLM", "lfm2_5_8b_a1b"),
    ("MiniMaxForCausalLM", "minimax_m1")], ids=lambda v: str(v))
def test_templates_that_ignore_enable_thinking_still_think(host: PluginHost, architecture: str, template: str) -> None:
    # Nemotron Nano 2 reads "/no_think" in the messages, LFM2.5 and MiniMax-M1 nothing: the model thinks anyway
    source, kwargs, question = TEMPLATES[template], {"enable_thinking": False}, [{"role": "user", "content": "Hi"}]
    prompt = JinjaChatTemplate(source).render(question, **kwargs)
    assert prompt == JinjaChatTemplate(source).render(question)
    text = "Hm.\n</think>\n\nSunny." if prompt.endswith("<think>\n") else "<think>\nHm.\n</think>\n\nSunny."
    entry = parser_entry(host.reasoning_parsers, None, "--reasoning-parser", architecture, source)
    assert entry is not None
    parser = entry.load()(None).start(ParseContext(prompt, chat_template_kwargs=kwargs))
    assert parser.split(text) == ("Hm.", "Sunny.")
