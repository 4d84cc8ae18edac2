"""How messages become a prompt: the ChatTemplate contract and the checks on messages and tools.

Templates come from plugins (the templates plugin renders Hugging Face Jinja templates and ships named
built-ins); which one serves a model is core.resolve's question (`resolve_chat_template`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import InvalidRequestError, UnsupportedError

Message = Mapping[str, Any]
# Content parts read as text (the key that holds it), and image parts (OpenAI's, Anthropic's and Hugging Face's).
TEXT_KEYS = {"text": "text", "input_text": "text", "refusal": "refusal"}
IMAGE_PART_TYPES = frozenset({"image_url", "image"})


class ChatTemplate(ABC):
    """Renders OpenAI-style messages into prompt text."""

    #: Text that ends an assistant turn (e.g. "<|im_end|>"): generation stops on it.
    stop_strings: tuple[str, ...] = ()
    #: Whether the tokenizer adds its special tokens (bos) when encoding the rendered text. Hugging Face
    #: templates write bos themselves, so the default is False (as transformers and vLLM do).
    encode_with_special_tokens: bool = False
    #: How the template reads `content` (core.content_format): "string" (text parts are joined before
    #: rendering) or "openai" (content is passed as the client sent it: a string or a list of parts).
    content_format: str = "openai"
    #: The template text this template renders (e.g. Jinja source), or None: parsers are chosen by
    #: markers in it (core.resolve.automatic_entry).
    source: str | None = None

    @abstractmethod
    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt for `messages`. A final assistant message is continued, not closed, when
        add_generation_prompt is False. `template_kwargs` are chat_template_kwargs (e.g.
        enable_thinking)."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of an OpenAI-style message list; a clear error names the bad item."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidRequestError(
                f"messages[{i}].role must be system, user, assistant or tool, got {role!r}",
                param=f"messages[{i}].role",
            )
        content = _checked_content(message.get("content"), f"messages[{i}].content")
        _check_tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise InvalidRequestError(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
        checked.append({**message, "content": content} if "content" in message else dict(message))
    return checked


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant turn's tool calls: null, or a list of calls, each naming its function (OpenAI's
    ``{"function": {"name", "arguments"}}``, or the flat ``{"name", "arguments"}`` that templates also read)
    with arguments as JSON text or an object."""
    if calls is None:
        return
    if not isinstance(calls, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a list of tool calls", param=where)
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f'{where}[{j}] must be an object whose "function" has a string "name"',
                                      param=f"{where}[{j}].function.name")
        if not isinstance(function.get("arguments", ""), (str, Mapping)):
            raise InvalidRequestError(f"{where}[{j}].function.arguments must be a string of JSON or an object",
                                      param=f"{where}[{j}].function.arguments")


def _checked_content(content: Any, where: str) -> Any:
    """Content is a string, null (an assistant turn of tool calls) or a list of parts, each an object with
    a string `type` (a text part with a string `text`); what an image part holds is checked by whoever
    reads it (core.media). As vLLM does, `refusal` (an assistant turn sent back as the API returned it) and
    `input_text` parts are read as text parts; parts of other types (audio, files) are a 400."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts", param=where)
    return [_checked_part(part, f"{where}[{j}]") for j, part in enumerate(content)]


def _checked_part(part: Any, where: str) -> Any:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise InvalidRequestError(f'{where} must be an object with a string "type"', param=where)
    kind = part["type"]
    if kind in IMAGE_PART_TYPES:
        return part
    if kind not in TEXT_KEYS:
        raise UnsupportedError(f"{where}: content parts of type {kind!r} are not supported (only text and images)",
                               param=f"{where}.type")
    text = part.get(TEXT_KEYS[kind])
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.{TEXT_KEYS[kind]} must be a string", param=f"{where}.{TEXT_KEYS[kind]}")
    return part if kind == "text" else {"type": "text", "text": text}


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check OpenAI function tools (what templates render); a clear error names the bad field."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list of tool objects", param="tools")
    return [_validate_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _validate_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    if tool.get("type") != "function":
        raise InvalidRequestError(f'{where}.type must be "function", got {tool.get("type")!r}', param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{where}.function must be an object with a name", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.function.name must be a non-empty string, got {name!r}",
                                  param=f"{where}.function.name")
    for key, kind, expected in (("parameters", Mapping, "an object (a JSON schema)"), ("description", str, "a string")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise InvalidRequestError(f"{where}.function.{key} must be {expected}", param=f"{where}.function.{key}")
    return dict(tool)
