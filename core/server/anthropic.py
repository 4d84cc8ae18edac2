"""Anthropic-compatible routes: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from core.errors import CoreError
from core.parsers import ToolCallFormat
from core.request import RequestOutput
from core.server import anthropic_protocol as ap
from core.server.anthropic_stream import ContentBlockEvents
from core.server.errors import Protocol, core_error_body, renamed_fields
from core.server.postprocess import ChatPostprocessor
from core.server.serving import (
    EventStreamResponse,
    Plan,
    check_model,
    collect_all,
    guarded_events,
    parse_body,
    start_route,
    state_of,
    until_disconnected,
)
from core.server.sse import sse_event

router = APIRouter()


def anthropic_error_event(exc: CoreError) -> str:
    """The `error` event that ends a stream that failed midway."""
    return sse_event("error", core_error_body(Protocol.ANTHROPIC, exc))


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    """Anthropic Messages: one assistant turn for the conversation."""
    state = state_of(request)
    started = await start_route(request, ap.MessagesRequest,
                                lambda req: _messages_plan(req, state.postprocessors.tool_call_format),
                                param_names=ap.PARAM_NAMES, id_prefix="msg_")
    req, message_id, [prepared], [source] = started.body, started.response_id, started.prepared, started.sources
    post = state.postprocessors.for_prepared(prepared, ap.parallel_tool_use(req))
    if req.stream:
        events = _message_events(message_id, started.model, len(prepared.prompt_token_ids), source, post,
                                 req.stop_sequences)
        return EventStreamResponse(guarded_events(events, anthropic_error_event, None),
                                   headers={"X-Request-Id": message_id}, closing=[source])
    [result] = await until_disconnected(request, collect_all([source]))
    parts = post.final(result.text)
    return JSONResponse(ap.message_response(message_id, started.model, result, req.stop_sequences, parts),
                        headers={"X-Request-Id": message_id})


def _messages_plan(req: ap.MessagesRequest, call_format: ToolCallFormat | None) -> Plan:
    tools, template_kwargs = ap.chat_tools(req), ap.chat_template_kwargs(req)
    config = ap.generation_config(req, ap.forced_tool_call(req, tools, call_format))
    chat, names = ap.translate_messages(req)
    options = {"tools": tools, "chat_template_kwargs": template_kwargs,
               "add_generation_prompt": not ap.is_prefill(chat)}
    return Plan([chat], config, options, names, reasoning=True)


async def _message_events(message_id: str, model: str, input_tokens: int, source: AsyncIterator[RequestOutput],
                          post: ChatPostprocessor, stop_sequences: list[str] | None) -> AsyncIterator[str]:
    yield sse_event("message_start", ap.message_start(message_id, model, input_tokens))
    blocks = ContentBlockEvents()
    for name, payload in blocks.open_text() if post.is_plain else ():
        yield sse_event(name, payload)
    yield sse_event("ping", {"type": "ping"})  # where Anthropic's streams have one: after the first block starts
    last: RequestOutput | None = None
    async for out in source:
        for name, payload in blocks.events(post.delta(0, out.text, finished=out.finish_reason is not None)):
            yield sse_event(name, payload)
        last = out
    for name, payload in blocks.finish():
        yield sse_event(name, payload)
    reason, sequence = ap.stop_reason(last.finish_reason if last else None, last.stop_reason if last else None,
                                      stop_sequences, post.called_tools(0))
    # The whole usage, as Anthropic's message_delta has it (the client's helper copies it onto the message).
    usage = ap.usage(input_tokens, last.completion_tokens if last else 0, last.cached_tokens if last else 0)
    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": usage}
    yield sse_event("message_delta", delta)
    yield sse_event("message_stop", {"type": "message_stop"})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """Prompt tokens the conversation would take, as /v1/messages renders it."""
    state = state_of(request)
    req = await parse_body(request, ap.CountTokensRequest)
    check_model(state, req.model)
    chat, names = ap.translate_messages(req)
    with renamed_fields(names):
        ids = await state.engine.tokenize_async(chat, tools=ap.chat_tools(req),
                                                chat_template_kwargs=ap.chat_template_kwargs(req),
                                                add_generation_prompt=not ap.is_prefill(chat))
    return {"input_tokens": len(ids)}
