"""Anthropic Messages API: request bodies and the pure translations to and from the engine."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.config import GenerationConfig
from core.errors import InvalidRequestError, UnsupportedError
from core.parsers import ToolCall, ToolCallFormat
from core.response import Response
from core.server.postprocess import ChatMessageParts
from core.server.structured_fields import one_constraint, output_format_constraint, tool_call_constraint
from core.structured_output import StructuredOutput

# Anthropic has no "aborted": an aborted turn (/abort, a sleep, a shutdown's drain) is paused, which tells the
# client that it stopped early and that sending its content back (a prefill) continues it. vLLM says end_turn,
# which reads as the model having finished.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "pause_turn"}
PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}


class ContentBlock(BaseModel):
    """A content block: text, thinking, tool_use (assistant turns) or tool_result (user turns)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(BaseModel):
    """One turn of the conversation."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]  # Anthropic's API refuses an empty list


class AnthropicTool(BaseModel):
    """A client tool: its name, description and the JSON schema of its input."""

    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range (OpenAI's is 0 to 2)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: structured output (structured_fields)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def block_text(content: str | list[ContentBlock] | None, param: str) -> str:
    """The text of a string or of text blocks (a system prompt, a tool result)."""
    if content is None or isinstance(content, str):
        return content or ""
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise UnsupportedError(f"{param}[{i}]: only text content blocks are supported here, got {block.type!r}",
                                   param=f"{param}.{i}")
    return "".join(block.text or "" for block in content)


# The fields each block type needs (an id or a name must not be empty either; a text may be).
_REQUIRED = {"text": ("text",), "thinking": ("thinking",), "tool_use": ("id", "name"),
             "tool_result": ("tool_use_id",)}


def _check_required(block: ContentBlock, param: str) -> None:
    for name in _REQUIRED.get(block.type, ()):
        value = getattr(block, name)
        if value is None or (value == "" and name not in ("text", "thinking")):
            raise InvalidRequestError(f"{param}.{name} is required in a {block.type} block",
                                      param=f"{param}.{name}")


def _unsupported_block(block: ContentBlock, role: str, param: str) -> UnsupportedError:
    allowed = "text, image and tool_result"
    if role == "assistant":
        allowed = "text, tool_use, thinking and redacted_thinking"
    return UnsupportedError(f"{param}: {role} content blocks of type {block.type!r} are not supported "
                            f"(only {allowed})", param=param)


def _user_messages(blocks: list[ContentBlock], param: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Tool results become role "tool" messages (in order), then the text is one user message (with its
    image blocks, when it has any, as content parts that the engine's media intake loads). Also returns
    the block index of each of those parts."""
    messages, texts, parts, origins = [], [], [], []
    for i, block in enumerate(blocks):
        _check_required(block, f"{param}.{i}")
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
            origins.append(i)
        elif block.type == "image":
            parts.append(block.model_dump(exclude_none=True))
            origins.append(i)
        elif block.type == "tool_result" and block.tool_use_id:
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": block_text(block.content, f"{param}.{i}.content")})
        else:
            raise _unsupported_block(block, "user", f"{param}.{i}")
    if len(parts) > len(texts):  # images
        return [*messages, {"role": "user", "content": parts}], origins
    return messages + ([{"role": "user", "content": "".join(texts)}] if texts or not messages else []), []


def _assistant_message(blocks: list[ContentBlock], param: str) -> dict[str, Any]:
    """Text, thinking (as reasoning_content) and tool_use blocks (as OpenAI tool_calls) of one turn
    (redacted_thinking blocks are dropped)."""
    texts, thinking, calls = [], [], []
    for i, block in enumerate(blocks):
        _check_required(block, f"{param}.{i}")
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking" and block.thinking is not None:
            thinking.append(block.thinking)
        elif block.type == "tool_use" and block.id and block.name:
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type != "redacted_thinking":  # encrypted reasoning only Anthropic's models read: dropped
            raise _unsupported_block(block, "assistant", f"{param}.{i}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def to_chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """OpenAI-style messages for the chat template: the system prompt first, then the turns; tool_use
    blocks become tool_calls and tool_result blocks role "tool" messages, as the templates expect."""
    return translate_messages(req)[0]


def translate_messages(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`to_chat_messages`, and the client's name of each translated message and content part
    (``messages[1].content[0]`` -> ``messages[0].content[2]``), for error messages."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    if req.system is not None:
        messages.append({"role": "system", "content": block_text(req.system, "system")})
    for i, message in enumerate(req.messages):
        param, first = f"messages.{i}.content", len(messages)
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_message(message.content, param))
        else:
            turn, origins = _user_messages(message.content, param)
            messages.extend(turn)
            names.update({f"messages[{len(messages) - 1}].content[{j}]": f"messages[{i}].content[{block}]"
                          for j, block in enumerate(origins)})
        names.update({f"messages[{c}]": f"messages[{i}]" for c in range(first, len(messages))})
    return messages, names


def is_prefill(chat: list[dict[str, Any]]) -> bool:
    """Whether the translated conversation ends with an assistant turn of text (no tool calls): Anthropic's
    prefill, which the response continues (rendered without a generation prompt, the template continuing
    that text) rather than answers."""
    last = chat[-1] if chat else {}
    return last.get("role") == "assistant" and not last.get("tool_calls") and bool(last.get("content"))


def chat_tools(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    """The request's tools as OpenAI function tools (what templates render); None when tool_choice is none."""
    kind = (req.tool_choice or {}).get("type", "auto")
    if kind == "none":
        return None
    if kind not in ("auto", "any", "tool"):
        raise InvalidRequestError(f'tool_choice.type must be "auto", "any", "tool" or "none", got {kind!r}',
                                  param="tool_choice.type")
    tools = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type not in (None, "custom"):
            raise UnsupportedError(f"tools[{i}]: server tools ({tool.type!r}) are not supported", param=f"tools.{i}")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools or None


def parallel_tool_use(req: MessagesRequest) -> bool:
    """Whether a response may make several tool calls (tool_choice's disable_parallel_tool_use: one at most)."""
    return not (req.tool_choice or {}).get("disable_parallel_tool_use")


THINKING_TYPES = ("enabled", "adaptive", "disabled")
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def chat_template_kwargs(req: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    """`thinking: {"type": "enabled" | "adaptive" | "disabled"}` as the templates' enable_thinking switch. An
    enabled one's budget_tokens is checked as Anthropic's API checks it (an integer of at least 1024, below
    max_tokens); the templates have no budget, so it limits nothing beyond max_tokens."""
    if req.thinking is None:
        return None
    kind = req.thinking.get("type")
    if kind not in THINKING_TYPES:
        raise InvalidRequestError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
                                  param="thinking.type")
    if kind == "enabled":
        max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else None  # count_tokens has none
        _check_thinking_budget(req.thinking.get("budget_tokens"), max_tokens)
    return {"enable_thinking": kind != "disabled"}


def _check_thinking_budget(budget: Any, max_tokens: int | None) -> None:
    if type(budget) is not int or budget < MIN_THINKING_BUDGET:
        raise InvalidRequestError(f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}, "
                                  f"got {budget!r}", param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                                  param="thinking.budget_tokens")


def forced_tool_call(req: MessagesRequest, tools: list[dict[str, Any]] | None,
                     call_format: ToolCallFormat | None) -> StructuredOutput | None:
    """The constraint of tool_choice ``{"type": "any"}`` or ``{"type": "tool", "name": ...}``, else None."""
    choice = req.tool_choice or {}
    if choice.get("type") == "any":
        return tool_call_constraint(tools, None, call_format)
    if choice.get("type") != "tool":
        return None
    if not isinstance(choice.get("name"), str):
        raise InvalidRequestError('tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice.name")
    return tool_call_constraint(tools, choice["name"], call_format, param="tool_choice.name")


def generation_config(req: MessagesRequest, forced_call: StructuredOutput | None = None) -> GenerationConfig:
    """GenerationConfig from the sent fields (unsent sampling fields take the model's defaults); a forced
    tool call's constraint or output_config.format as its structured output."""
    constraint = one_constraint(forced_call, output_format_constraint(req.output_config))
    fields: dict[str, Any] = {"max_new_tokens": req.max_tokens, "structured_output": constraint}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop_sequences:
        fields["stop"] = tuple(req.stop_sequences)
    return GenerationConfig(**fields)


def stop_reason(finish_reason: str | None, stop: str | int | None, stop_sequences: list[str] | None,
                tool_use: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a user stop sequence reads as stop_sequence, not end_turn; a turn
    that ended by itself after a tool call reads as tool_use; an aborted one as pause_turn."""
    if finish_reason == "stop" and isinstance(stop, str) and stop in (stop_sequences or ()):
        return "stop_sequence", stop
    if finish_reason == "stop" and tool_use:
        return "tool_use", None
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, int]:
    """Anthropic's usage object."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_read_input_tokens": cached}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A whole `tool_use` content block."""
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input()}


def content_blocks(parts: ChatMessageParts) -> list[dict[str, Any]]:
    """thinking, text and tool_use blocks of a whole response (one empty text block when it has none)."""
    blocks: list[dict[str, Any]] = []
    if parts.reasoning_content:
        blocks.append({"type": "thinking", "thinking": parts.reasoning_content, "signature": ""})
    if parts.content:
        blocks.append({"type": "text", "text": parts.content})
    blocks += [tool_use_block(call) for call in parts.tool_calls]
    return blocks or [{"type": "text", "text": ""}]


def message_response(message_id: str, model: str, result: Response, stop_sequences: list[str] | None,
                     parts: ChatMessageParts | None = None) -> dict[str, Any]:
    """A whole `message` object; `parts` is the parsed response text (default: all of it is text)."""
    choice = result.choices[0]
    parts = parts or ChatMessageParts(content=choice.text)
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences, bool(parts.tool_calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(parts), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}


def message_start(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The `message_start` event's payload."""
    message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage(input_tokens, 0)}
    return {"type": "message_start", "message": message}
