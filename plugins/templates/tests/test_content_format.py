"""Content format: detected from the template's syntax tree, and content parts rendered as transformers'
apply_chat_template renders the equivalent input (joined text for string templates, parts as sent for
list templates), in every role."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.backend import ModelInfo
from core.request import RequestPreparer
from core_templates.content_format import detect_content_format
from core_templates.jinja_template import JinjaChatTemplate, compile_template

DATA = Path(__file__).parent / "data"
EXPECTED = {"smollm2": "string", "qwen2.5": "string", "deepseek_r1": "string", "llama3": "string",
            "mistral": "string", "qwen3": "string", "chatml": "string", "gemma": "openai", "completion": "openai",
            "gpt_oss": "string", "deepseek_v3": "string", "deepseek_v31": "string",
            # these walk a list of parts where content is not a string
            "kimi_k2": "openai", "glm46": "openai", "llama4_pythonic": "openai"}


def _format(source: str) -> str:
    return detect_content_format(source, compile_template(source).environment)


def test_real_templates_are_detected(template_name: str, templates: dict[str, Any]):
    assert JinjaChatTemplate(templates[template_name][0]).content_format == EXPECTED[template_name]


def test_qwen2_vl_reads_parts():
    assert _format((DATA / "qwen2_vl.jinja").read_text()) == "openai"


@pytest.mark.parametrize(("source", "expected"), [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # through an assigned slice of messages, and a loop over `content or []`
    ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content or [] %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    # a message assigned from the loop variable
    ("{% for x in messages %}{% set m = x %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}", "openai"),
    ("{% for p in messages[0]['content'] %}{{ p.text }}{% endfor %}", "openai"),
    ("{% for m in other %}{% for p in m.content %}{% endfor %}{% endfor %}", "string"),  # not the messages
    ("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
])
def test_detection_rules(source: str, expected: str):
    assert _format(source) == expected


def test_a_template_that_does_not_parse_reads_strings():
    assert detect_content_format("{% for %}", compile_template("x").environment) == "string"


def _parts(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}, {"type": "text", "text": "second line"}]


CALL = {"id": "call1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
PART_MESSAGES = [
    {"role": "system", "content": _parts("Be brief.")},
    {"role": "user", "content": _parts("Hello?")},
    {"role": "assistant", "content": _parts("Hi.")},
    {"role": "tool", "tool_call_id": "call1", "content": _parts('{"ok": true}')},
    {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
]


def _joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": "\n".join(p["text"] for p in m["content"])} for m in messages]


def _preparer(source: str, tokenizer: Any, content_format: str = "auto") -> RequestPreparer:
    info = ModelInfo(name="m", architecture="LlamaForCausalLM", max_model_len=4096)
    return RequestPreparer(info, tokenizer, JinjaChatTemplate(source, tokenizer), content_format=content_format)


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "llama3"])
def test_string_templates_render_parts_as_their_joined_text(name: str, templates: dict[str, Any], make_tokenizer):
    source, bos, eos = templates[name]
    tokenizer = make_tokenizer(bos, eos, source)
    messages = PART_MESSAGES if name != "smollm2" else [m for m in PART_MESSAGES if m["role"] != "tool"]
    expected = tokenizer.apply_chat_template(_joined(messages), tokenize=False, add_generation_prompt=True)
    assert _preparer(source, tokenizer).render(messages) == expected
    assert "Be brief.\nsecond line" in expected


def test_list_templates_get_the_parts_as_sent(make_tokenizer):
    source = (DATA / "qwen2_vl.jinja").read_text()
    tokenizer = make_tokenizer(None, "<|im_end|>", source)
    expected = tokenizer.apply_chat_template(PART_MESSAGES, tokenize=False, add_generation_prompt=True)
    assert _preparer(source, tokenizer).render(PART_MESSAGES) == expected
    # plain strings pass through unchanged too
    strings = _joined(PART_MESSAGES)
    assert _preparer(source, tokenizer).render(strings) == tokenizer.apply_chat_template(
        strings, tokenize=False, add_generation_prompt=True)


def test_the_override_wins_over_detection(templates: dict[str, Any], make_tokenizer):
    source, bos, eos = templates["smollm2"]
    tokenizer = make_tokenizer(bos, eos, source)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _preparer(source, tokenizer, "string").content_format == "string"
    openai = _preparer(source, tokenizer, "openai")
    assert openai.content_format == "openai"
    with pytest.raises(ValueError, match="rejected the messages"):  # the template concatenates a list
        openai.render(messages)

