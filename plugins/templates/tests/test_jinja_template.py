"""The renderer matches transformers' apply_chat_template exactly, template by template, case by case."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from core.errors import InvalidRequestError
from core_templates.jinja_template import JinjaChatTemplate

pytest.importorskip("transformers")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "abc123XYZ", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the weather in Paris? <b>&</b> ünïcode"}

# case name -> (messages, add_generation_prompt, tools, chat_template_kwargs)
CASES: dict[str, tuple[list[dict[str, Any]], bool, list[dict[str, Any]] | None, dict[str, Any]]] = {
    "system_prompt": ([SYSTEM, USER], True, None, {}),
    "multi_turn": ([USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow?"}],
                   True, None, {}),
    "no_generation_prompt": ([USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Ok"}],
                             False, None, {}),
    "tools": ([SYSTEM, USER], True, [WEATHER_TOOL], {}),
    "tool_results": ([USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                      {"role": "tool", "tool_call_id": "abc123XYZ", "content": '{"temp": 21}'}],
                     True, [WEATHER_TOOL], {}),
    "thinking_on": ([USER], True, None, {"enable_thinking": True}),
    "thinking_off": ([USER], True, None, {"enable_thinking": False}),
    "reasoning_history": ([USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}],
                          False, None, {}),
    "continue_final": ([SYSTEM, USER, {"role": "assistant", "content": "The weather is "}], False, None, {}),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], True, None, {}),
}

# Combinations the template itself refuses, in transformers and here alike (a clear request error here).
REJECTED = {
    ("gemma", "tool_results"),  # Gemma 3 has no tool role: "roles must alternate"
    ("smollm2", "content_parts"),  # these templates concatenate content as a string
    ("qwen2.5", "content_parts"),
    ("mistral", "content_parts"),
    ("deepseek_r1", "content_parts"),
    ("deepseek_v3", "content_parts"),
    ("deepseek_v31", "content_parts"),
    ("gpt_oss", "content_parts"),
}


# Templates that read every message's content, which transformers refuses a turn of tool calls only
# (content None); here, as in vLLM, that content renders as empty text (compared with transformers given "").
EMPTY_CONTENT = {("smollm2", "tool_results"), ("deepseek_r1", "tool_results"), ("deepseek_v3", "tool_results")}


def render_both(template: tuple[str, str | None, str | None], make_tokenizer: Any, case: str,
                empty_content: bool = False) -> tuple[Any, Any]:
    """(transformers' output or the exception it raised, ours or the exception we raised); `empty_content`:
    transformers is given "" where a message's content is None."""
    source, bos, eos = template
    results = []
    for ours in (False, True):
        messages, add_generation_prompt, tools, kwargs = copy.deepcopy(CASES[case])
        if empty_content and not ours:
            messages = [{**m, "content": "" if m["content"] is None else m["content"]} for m in messages]
        try:
            if ours:
                results.append(JinjaChatTemplate(source, make_tokenizer(bos, eos)).render(
                    messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs))
            else:
                results.append(make_tokenizer(bos, eos, source).apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt and messages[-1]["role"] == "assistant",
                    **kwargs))
        except Exception as exc:  # a template refusing the conversation
            results.append(exc)
    return results[0], results[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(templates: Any, make_tokenizer: Any, template_name: str, case: str) -> None:
    filled = (template_name, case) in EMPTY_CONTENT
    if filled:
        assert isinstance(render_both(templates[template_name], make_tokenizer, case)[0], Exception), \
            "transformers now renders it: remove it from EMPTY_CONTENT"
    expected, ours = render_both(templates[template_name], make_tokenizer, case, empty_content=filled)
    if (template_name, case) in REJECTED:
        assert isinstance(expected, Exception), "now renders: remove it from REJECTED"
        assert isinstance(ours, InvalidRequestError)
    else:
        assert not isinstance(expected, Exception), f"transformers failed unexpectedly: {expected!r}"
        assert ours == expected


def test_openai_string_arguments_render_like_objects(templates: Any, make_tokenizer: Any) -> None:
    source, bos, eos = templates["qwen2.5"]
    messages, _, tools, _ = copy.deepcopy(CASES["tool_results"])
    as_text = copy.deepcopy(messages)
    as_text[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris", "days": 2})
    template = JinjaChatTemplate(source, make_tokenizer(bos, eos))
    assert template.render(as_text, tools=tools) == template.render(messages, tools=tools)
    assert '"arguments": {"city": "Paris", "days": 2}' in template.render(as_text, tools=tools)


def test_caller_messages_are_not_modified(templates: Any) -> None:
    messages = copy.deepcopy(CASES["continue_final"][0])
    before = copy.deepcopy(messages)
    JinjaChatTemplate(templates["qwen3"][0]).render(messages, add_generation_prompt=False)
    assert messages == before


def test_sandbox_blocks_python_internals() -> None:
    template = JinjaChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        template.render([USER])


def test_template_globals_match_transformers() -> None:
    source = "{{ raise_exception('no') if messages|length > 1 }}{{ {'a': '<&>'}|tojson }}{{ strftime_now('%Y') }}"
    template = JinjaChatTemplate(source)
    assert template.render([USER]).startswith('{"a": "<&>"}20')
    with pytest.raises(InvalidRequestError, match="no"):
        template.render([USER, USER])


def test_tokenizer_may_be_none(templates: Any) -> None:
    template = JinjaChatTemplate(templates["llama3"][0], None)
    assert template.render([USER]).startswith("<|start_header_id|>system")
    assert template.stop_strings == ("<|eot_id|>",)


def test_generation_blocks_render_their_body(make_tokenizer: Any) -> None:
    source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}" \
             "{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
    messages = [USER, {"role": "assistant", "content": "ok"}, USER]
    expected = make_tokenizer("<s>", "</s>", source).apply_chat_template(messages, tokenize=False)
    assert JinjaChatTemplate(source).render(messages, add_generation_prompt=False) == expected
