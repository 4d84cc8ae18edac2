"""How message content reaches the chat template: as a string, or as a list of parts.

Clients send `content` either as a string or as OpenAI content parts (``[{"type": "text", "text": ...}]``).
Templates read one or the other (vLLM's "content format"): a "string" template concatenates content
(SmolLM2, Llama 3), an "openai" template loops over parts (Qwen2-VL, Llama 4). For a string template the
text parts of each message are joined with a newline, as vLLM does; for a list template content passes
through as sent. A message holding anything but text parts (an image) is left as it is: only the vision
path knows how to render it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import InvalidRequestError

AUTO, STRING, OPENAI = "auto", "string", "openai"
CONTENT_FORMATS = (AUTO, STRING, OPENAI)
TEXT_PART_TYPES = frozenset({"text"})


def check_content_format(value: Any, name: str = "chat_template_content_format") -> str:
    """`value` if it is one of CONTENT_FORMATS, else a clear error naming `name`."""
    if value not in CONTENT_FORMATS:
        raise InvalidRequestError(f"{name} must be one of {', '.join(CONTENT_FORMATS)}, got {value!r}", param=name)
    return value


def resolve_content_format(requested: str, detected: str) -> str:
    """The format to use: the user's choice unless "auto", else what the template declares."""
    return detected if check_content_format(requested) == AUTO else requested


def apply_content_format(messages: Sequence[Mapping[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """Copies of `messages` with their content in `content_format` ("string" joins text parts)."""
    if content_format != STRING:
        return [dict(m) for m in messages]
    return [_with_joined_text(m) for m in messages]


def _with_joined_text(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, (list, tuple)) or not all(_is_text_part(p) for p in content):
        return dict(message)
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str)
