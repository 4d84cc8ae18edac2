"""The plugin through the core: built-ins by name and architecture, overrides, stop strings, parsers."""

from __future__ import annotations

from typing import Any

import pytest

from core import hookimpl
from core.backend import ModelInfo
from core.chat_template import ChatTemplate
from core.errors import PluginError
from core.parsers import ReasoningParser, ToolCallParser
from core.plugins import PluginHost
from core.resolve import resolve_chat_template
from core_templates.jinja_template import JinjaChatTemplate
from core_templates.plugin import BUILTIN_TEMPLATES, REASONING_PARSERS, TOOL_CALL_PARSERS

USER = [{"role": "user", "content": "Hi"}]


def model(architecture: str = "UnknownForCausalLM", chat_template: str | None = None) -> ModelInfo:
    return ModelInfo(name="m", architecture=architecture, max_model_len=128, chat_template=chat_template)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_by_name(host: PluginHost, name: str) -> None:
    template = resolve_chat_template(host, name, model(), None)
    assert isinstance(template, JinjaChatTemplate)
    assert template.render(USER)


@pytest.mark.parametrize(("architecture", "name"), [
    (arch, name) for name, archs in BUILTIN_TEMPLATES.items() for arch in archs
])
def test_builtin_by_architecture(host: PluginHost, architecture: str, name: str) -> None:
    template = resolve_chat_template(host, None, model(architecture), None)
    expected = host.chat_templates.get(name).load()(None)
    assert template.render(USER) == expected.render(USER)


def test_no_architecture_in_two_builtins() -> None:
    architectures = [a for archs in BUILTIN_TEMPLATES.values() for a in archs]
    assert len(architectures) == len(set(architectures))


def test_expected_architectures(host: PluginHost) -> None:
    qwen3 = resolve_chat_template(host, None, model("Qwen3ForCausalLM"), None)
    assert "<think>" in qwen3.render(USER, enable_thinking=False)
    llama = resolve_chat_template(host, None, model("LlamaForCausalLM"), None)
    assert "<|start_header_id|>" in llama.render(USER)
    assert resolve_chat_template(host, None, model("UnknownForCausalLM"), None) is None


def test_model_template_beats_architecture(host: PluginHost) -> None:
    template = resolve_chat_template(host, None, model("Qwen3ForCausalLM", "{{ messages[0].content }}!"), None)
    assert template.render(USER) == "Hi!"


def test_template_file(host: PluginHost, tmp_path: Any, make_tokenizer: Any) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{{ messages[0].content }}")
    template = resolve_chat_template(host, str(path), model(), make_tokenizer("<s>", "</s>"))
    assert template.render(USER) == "<s>Hi"


def test_invalid_template_is_a_clear_error(host: PluginHost) -> None:
    with pytest.raises(PluginError, match="not valid Jinja"):
        resolve_chat_template(host, None, model(chat_template="{% for %}"), None)


class ThirdPartyTemplates:
    """A plugin that replaces the built-in ChatML on purpose."""

    @hookimpl
    def core_register_chat_templates(self, register) -> None:
        register("chatml", lambda tokenizer: JinjaChatTemplate("third-party"), override=True)


def test_third_party_overrides_builtin(host: PluginHost) -> None:
    host.register(ThirdPartyTemplates(), name="third_party")
    template = resolve_chat_template(host, "chatml", model(), None)
    assert template.render(USER) == "third-party"
    assert host.chat_templates.get("chatml").plugin == "third_party"


def test_third_party_without_override_conflicts(host: PluginHost) -> None:
    class Clash:
        @hookimpl
        def core_register_chat_templates(self, register) -> None:
            register("chatml", lambda tokenizer: JinjaChatTemplate(""))

    host.register(Clash(), name="clash")
    with pytest.raises(PluginError, match="templates"):
        host.chat_templates.get("chatml")


@pytest.mark.parametrize(("name", "stop"), [
    ("smollm2", "<|im_end|>"), ("chatml", "<|im_end|>"), ("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>"),
    ("gemma", "<end_of_turn>"), ("mistral", "</s>"), ("deepseek_r1", "<｜end▁of▁sentence｜>"),
])
def test_stop_strings(templates: Any, make_tokenizer: Any, name: str, stop: str) -> None:
    source, bos, eos = templates[name]
    template = JinjaChatTemplate(source, make_tokenizer(bos, eos))
    assert template.stop_strings[0] == stop
    assert eos in template.stop_strings
    assert isinstance(template, ChatTemplate) and not template.encode_with_special_tokens


def test_gemma_stop_strings_include_eos(templates: Any, make_tokenizer: Any) -> None:
    source, bos, eos = templates["gemma"]
    assert JinjaChatTemplate(source, make_tokenizer(bos, eos)).stop_strings == ("<end_of_turn>", "<eos>")


def test_completion_has_only_eos(templates: Any, make_tokenizer: Any) -> None:
    source = templates["completion"][0]
    assert JinjaChatTemplate(source, make_tokenizer(None, "</s>")).stop_strings == ("</s>",)
    assert JinjaChatTemplate(source).render(USER * 2) == "HiHi"


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_parsers_load(host: PluginHost, name: str) -> None:
    entry = host.reasoning_parsers.get(name)
    assert isinstance(entry.load()(None), ReasoningParser)
    assert entry.meta["architectures"] == REASONING_PARSERS[name].architectures
    assert entry.meta["chat_template_contains"] == REASONING_PARSERS[name].chat_template_contains


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_tool_call_parsers_load(host: PluginHost, name: str) -> None:
    assert isinstance(host.tool_call_parsers.get(name).load()(None), ToolCallParser)
