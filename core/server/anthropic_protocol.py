"""Anthropic Messages API: request bodies and the pure translations to and from the engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.config import GenerationConfig
from core.errors import UnsupportedError
from core.response import Response

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
# Anthropic has no "aborted": like vLLM, anything else reads as end_turn.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}


class TextBlock(BaseModel):
    """A content block; only text is supported."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class AnthropicMessage(BaseModel):
    """One turn of the conversation."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None


def block_text(content: str | list[TextBlock], param: str) -> str:
    """The text of a string or of text blocks; other block types are not supported yet."""
    if isinstance(content, str):
        return content
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise UnsupportedError(f"{param}[{i}]: only text content blocks are supported, got {block.type!r}",
                                   param=f"{param}.{i}")
    return "".join(block.text or "" for block in content)


def to_chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """OpenAI-style messages for the chat template: the system prompt first, then the turns."""
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": block_text(req.system, "system")})
    for i, message in enumerate(req.messages):
        messages.append({"role": message.role, "content": block_text(message.content, f"messages.{i}.content")})
    return messages


def generation_config(req: MessagesRequest) -> GenerationConfig:
    """GenerationConfig from the sent fields (unsent sampling fields take the model's defaults)."""
    fields: dict[str, Any] = {"max_new_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop_sequences:
        fields["stop"] = tuple(req.stop_sequences)
    return GenerationConfig(**fields)


def stop_reason(finish_reason: str | None, stop: str | int | None, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a user stop sequence reads as stop_sequence, not end_turn."""
    if finish_reason == "stop" and isinstance(stop, str) and stop in (stop_sequences or ()):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, int]:
    """Anthropic's usage object."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_read_input_tokens": cached}


def message_response(message_id: str, model: str, result: Response, stop_sequences: list[str] | None) -> dict[str, Any]:
    """A whole `message` object."""
    choice = result.choices[0]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": choice.text}], "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}


def message_start(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The `message_start` event's payload."""
    message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage(input_tokens, 0)}
    return {"type": "message_start", "message": message}
