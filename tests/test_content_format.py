"""core.content_format: text parts joined for string templates, everything else as sent."""

from __future__ import annotations

import pytest

from core.content_format import apply_content_format, check_content_format, resolve_content_format
from core.errors import InvalidRequestError


def test_string_format_joins_text_parts_with_a_newline_in_every_role():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": role, "content": parts} for role in ("system", "user", "assistant", "tool")]
    assert [m["content"] for m in apply_content_format(messages, "string")] == ["a\nb"] * 4
    assert messages[0]["content"] is parts  # the caller's messages are not changed


def test_string_format_keeps_strings_none_and_messages_with_images():
    image = [{"type": "image"}, {"type": "text", "text": "what?"}]
    messages = [{"role": "user", "content": "plain"}, {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "user", "content": image}, {"role": "user", "content": []}]
    out = apply_content_format(messages, "string")
    assert [m["content"] for m in out] == ["plain", None, image, ""]


def test_openai_format_passes_content_through():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert apply_content_format(messages, "openai") == messages


def test_resolution_and_validation():
    assert resolve_content_format("auto", "openai") == "openai"
    assert resolve_content_format("string", "openai") == "string"
    with pytest.raises(InvalidRequestError, match="chat_template_content_format must be one of auto, string, openai"):
        check_content_format("list")
