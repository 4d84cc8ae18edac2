"""OpenAI Responses API: the request body, its translation into a chat request, and the output objects.

A Responses request is run as the chat request it translates to (`to_chat_request`): `input` items become
chat messages (`instructions` a system message first), function tools and `tool_choice` the chat path's,
`text.format` its `response_format`, `reasoning.effort` the templates' `enable_thinking` switch, and
`include: ["message.output_text.logprobs"]` with `top_logprobs` its logprobs (on the message's output_text). The
server keeps no state, so `previous_response_id`, `conversation`, a stored `prompt`, item references,
`store: true` and `background` are refused with a 400 that says so. Nothing here touches the network or the
engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from core.config import MAX_TOP_LOGPROBS
from core.errors import InvalidRequestError, UnsupportedError
from core.parsers import ToolCall
from core.server.openai_protocol import ChatCompletionRequest, Temperature, check_name
from core.server.openai_translate import reasoning_switch
from core.server.postprocess import ChatMessageParts

STATELESS = "this server keeps no state between requests: send the whole conversation in `input`"
# Engine and chat field names -> the Responses request's own, for error messages.
PARAM_NAMES = {"max_new_tokens": "max_output_tokens", "response_format": "text.format",
               "structured_output": "text.format"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# The API's `include` values: the others name what tools this server does not run return, or an encrypted
# reasoning item it does not make (agent clients ask for it with store false), so there is nothing to add.
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (unknown fields are accepted and ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Temperature = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template, by id: refused (no state)
    metadata: dict[str, Any] | None = None
    user: str | None = None


def check_stateless(req: ResponsesRequest) -> None:
    """Refuse what needs server-side state (a stored response, a conversation, a background run)."""
    if req.previous_response_id is not None:
        raise InvalidRequestError(f"previous_response_id is not supported: {STATELESS}", param="previous_response_id")
    if req.conversation is not None:
        raise InvalidRequestError(f"conversation is not supported: {STATELESS}", param="conversation")
    if req.prompt is not None:
        raise InvalidRequestError(f"prompt (a stored prompt template) is not supported: {STATELESS}",
                                  param="prompt")
    if req.store:
        raise InvalidRequestError(f"store must be false: {STATELESS}", param="store")
    if req.background:
        raise UnsupportedError("background responses are not supported", param="background")


def to_chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """The chat request that runs `req`, and the client's name of each translated message (for errors)."""
    check_stateless(req)
    logprobs = wants_logprobs(req)
    messages, names = input_messages(req.input)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
        names = {f"messages[{int(k[9:-1]) + 1}]": v for k, v in names.items()}
    names["messages"] = "input"  # the conversation as a whole (a prompt too long for the context window)
    chat = ChatCompletionRequest(
        messages=messages, stream=req.stream, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text), chat_template_kwargs=_template_kwargs(req.reasoning),
        logprobs=logprobs or None, top_logprobs=req.top_logprobs if logprobs else None)
    return chat, names


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether `include` asks for the output text's logprobs; an `include` value the API does not define, or a
    `top_logprobs` outside 0-20, is a 400 naming it (as OpenAI answers), whether logprobs are asked for or not."""
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDABLE:
            raise InvalidRequestError(f"include[{i}] must be one of {', '.join(INCLUDABLE)}, got {value!r}",
                                      param="include")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}, "
                                  f"got {req.top_logprobs}", param="top_logprobs")
    return OUTPUT_LOGPROBS in (req.include or ())


def input_messages(items: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Chat messages of `input`: messages (any role; developer reads as system), function calls (on the
    assistant turn before them), function call outputs (role "tool"), reasoning (reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], {"messages[0]": "input"}
    if not items:
        raise InvalidRequestError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
        names.setdefault(f"messages[{len(messages) - 1}]", f"input[{i}]")
    return messages, names


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind in ("function_call", "function_call_output") and not isinstance(item.get("call_id"), str):
        raise InvalidRequestError(f"{param}.call_id must be a string", param=f"{param}.call_id")
    if kind == "message":
        message = _message(item, param)
        if message["role"] == "assistant" and messages and _only_reasoning(messages[-1]):
            messages[-1]["content"] = message["content"]  # the text after a reasoning item: the same turn
        else:
            messages.append(message)
    elif kind == "function_call":
        for field in ("name", "arguments"):
            if not isinstance(item.get(field, ""), str):
                raise InvalidRequestError(f"{param}.{field} must be a string", param=f"{param}.{field}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        _open_assistant(messages).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output", ""), f"{param}.output")})
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        messages.append({"role": "assistant", "content": None, "reasoning_content": _text(parts, param)})
    elif kind == "item_reference":
        raise InvalidRequestError(f"{param}: item references are not supported: {STATELESS}", param=param)
    else:
        raise UnsupportedError(f"{param}: input items of type {kind!r} are not supported", param=f"{param}.type")


def _only_reasoning(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant" and message["content"] is None and "tool_calls" not in message


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn a function call belongs to: the last message when it is one, else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
    if role is None:
        raise InvalidRequestError(f"{param}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}",
                                  param=f"{param}.role")
    content = item.get("content", "")
    if role != "user" or not isinstance(content, list):
        return {"role": role, "content": _text(content, f"{param}.content")}
    return {"role": role, "content": [_user_part(part, f"{param}.content[{j}]") for j, part in enumerate(content)]}


def _user_part(part: Any, param: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if kind == "input_image":
        raise UnsupportedError(f"{param}: images are read from image_url only (no file_id)", param=param)
    raise UnsupportedError(f"{param}: content parts of type {kind!r} are not supported", param=param)


def _text(content: Any, param: str) -> str:
    """A string, or the text of text parts (the roles whose templates take text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of content parts", param=param)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise UnsupportedError(f"{param}[{j}]: only text parts are supported here", param=f"{param}[{j}]")
        if not isinstance(part.get("text", ""), str):
            raise InvalidRequestError(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
    return "".join(part.get("text", "") for part in content)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat function tools; another tool type, or a name OpenAI refuses, is a
    400."""
    if not tools:
        return None
    chat = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise UnsupportedError(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}",
                                   param=f"tools[{i}].type")
        check_name(tool.get("name"), f"tools[{i}].name")
        chat.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return chat


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (json_schema's fields, its required name among them, move under
    `json_schema`)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        check_name(fmt.get("name"), "text.format.name")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


def _template_kwargs(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    """`reasoning.effort` as chat's reasoning_effort: "none" turns a reasoning template's thinking off."""
    return reasoning_switch((reasoning or {}).get("effort"), "reasoning.effort")


# -- output ----------------------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    """A fresh output item id (msg_..., fc_..., rs_...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item: str, text: str, status: str = "completed",
                 logprobs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """An assistant message item holding one output_text part (none while it is in progress)."""
    content = [] if status == "in_progress" else [output_text_part(text, logprobs)]
    return {"id": item, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text_part(text: str = "", logprobs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """An output_text content part; `logprobs` are chat's entries (token, bytes, logprob, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def reasoning_item(item: str, text: str | None = None) -> dict[str, Any]:
    """A reasoning item: its text as one reasoning_text part (none while it streams)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item, "type": "reasoning", "summary": [], "content": content}


def function_call_item(item: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A function_call item (call_id is what the client's function_call_output answers)."""
    return {"id": item, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(parts: ChatMessageParts, logprobs: Sequence[dict[str, Any]] = (),
                 status: str = "completed") -> list[dict[str, Any]]:
    """The output of a whole response: reasoning, the message (with the logprobs of every output token, as
    vLLM gives them), then each function call; the last item is "incomplete" in a response of `status`
    other than "completed" (the model was writing it when it stopped)."""
    items = [reasoning_item(item_id("rs"), parts.reasoning_content)] if parts.reasoning_content else []
    if parts.content or not parts.tool_calls:
        items.append(message_item(item_id("msg"), parts.content or "", logprobs=logprobs))
    items += [_call_item(call) for call in parts.tool_calls]
    items[-1]["status"] = item_status(status)  # a message or a function call: the one it was writing last
    return items


def _call_item(call: ToolCall) -> dict[str, Any]:
    return function_call_item(item_id("fc"), call.id, call.name, call.arguments)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The Responses usage object (reasoning tokens are not counted apart; the prefix cache is no prompt cache a
    request writes to, so cache_write_tokens, which the client requires, is 0)."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def status_of(finish_reason: str | None) -> str:
    """The Responses status of the engine's finish reason: "completed" only when the model stopped (an eos or
    stop token, a stop string); "incomplete" at the token limit (incomplete_details says max_output_tokens);
    "cancelled" when it was aborted (/abort, a sleep, a shutdown's drain) or ended without a finish reason."""
    return {"stop": "completed", "length": "incomplete"}.get(finish_reason or "", "cancelled")


def item_status(status: str) -> str:
    """The status of the output item being written when a response of `status` ended."""
    return "completed" if status == "completed" else "incomplete"


def end_event(status: str) -> str:
    """The event that ends a stream of a response of `status`: the API defines three (completed, incomplete,
    failed), none for a cancelled response, which did not complete either."""
    return "response.completed" if status == "completed" else "response.incomplete"


def response_object(response_id: str, created: int, model: str, req: ResponsesRequest, *, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
    """A `response` object; the request's settings are echoed back as OpenAI does."""
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage_, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning, "store": False,
            "background": False, "previous_response_id": None, "metadata": req.metadata or {},
            "truncation": "disabled", "user": req.user}
