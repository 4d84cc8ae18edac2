"""The OpenAI Responses route: POST /v1/responses, whole or streamed, run as the chat request it translates to.

The body becomes a chat request (core.server.responses_protocol) that goes the chat route's way (its
plan, the engine, the same reasoning and tool-call postprocessing); only the output's shape differs:
output items instead of choices, and named events (core.server.responses_stream) instead of chunks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from core.backend import TokenLogprob
from core.errors import CoreError
from core.parsers import ToolCallFormat
from core.request import RequestOutput
from core.server import openai_translate as tr
from core.server import responses_protocol as rp
from core.server.errors import Protocol, core_error_body
from core.server.openai import chat_plan
from core.server.postprocess import ChatPostprocessor
from core.server.responses_stream import ResponseEvents
from core.server.serving import (
    EventStreamResponse,
    Plan,
    ServerState,
    collect_all,
    guarded_events,
    start_route,
    state_of,
    until_disconnected,
)
from core.server.sse import sse_event

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """One model response to `input` (streamed as named SSE events when `stream` is true)."""
    state = state_of(request)
    call_format = state.postprocessors.tool_call_format
    started = await start_route(request, rp.ResponsesRequest, lambda req: _plan(req, call_format),
                                param_names=rp.PARAM_NAMES, id_prefix="resp_")
    req, response_id, [prepared], [source] = started.body, started.response_id, started.prepared, started.sources
    post = state.postprocessors.for_prepared(prepared, req.parallel_tool_calls is not False)
    created = int(time.time())
    headers = {"X-Request-Id": response_id}
    describe = _Describe(response_id, created, started.model, req)
    if req.stream:
        stream = ResponseEvents()
        events = _events(state, describe, stream, source, post)
        return EventStreamResponse(guarded_events(events, lambda exc: _error_event(stream, exc), None),
                                   headers=headers, closing=[source])
    [result] = await until_disconnected(request, collect_all([source]))
    status = rp.status_of(result.finish_reason)
    output = rp.output_items(post.final(result.text), _logprobs(state, result.choices[0].logprobs), status)
    usage = rp.usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
    return JSONResponse(describe(status, output, usage), headers=headers)


def _plan(req: rp.ResponsesRequest, call_format: ToolCallFormat | None) -> Plan:
    chat, names = rp.to_chat_request(req)
    return dataclasses.replace(chat_plan(chat, call_format), field_names=names)


@dataclasses.dataclass(frozen=True)
class _Describe:
    """The `response` object of one request at any stage (status, output so far, usage)."""

    response_id: str
    created: int
    model: str
    req: rp.ResponsesRequest

    def __call__(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return rp.response_object(self.response_id, self.created, self.model, self.req, status=status,
                                  output=output, usage_=usage)


async def _events(state: ServerState, describe: _Describe, stream: ResponseEvents, source: AsyncIterator[RequestOutput],
                  post: ChatPostprocessor) -> AsyncIterator[str]:
    for kind in ("response.created", "response.in_progress"):
        yield _sse(stream.event(kind, response=describe("in_progress", [], None)))
    last: RequestOutput | None = None
    async for out in source:
        pieces = post.delta(0, out.text, finished=out.finish_reason is not None)
        for event in stream.events(pieces, _logprobs(state, out.logprobs)):
            yield _sse(event)
        last = out
    status = rp.status_of(last.finish_reason if last else None)
    for event in stream.finish(status):
        yield _sse(event)
    usage = rp.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens) if last else rp.usage(0, 0)
    yield _sse(stream.event(rp.end_event(status), response=describe(status, stream.output, usage)))


def _logprobs(state: ServerState, entries: Sequence[TokenLogprob] | None) -> list[dict[str, Any]]:
    """Chat's logprob entries of `entries` (none when the request did not include them)."""
    return (tr.chat_logprobs(entries, state.engine.detokenize) or {"content": []})["content"]


def _error_event(stream: ResponseEvents, exc: CoreError) -> str:
    """The `error` event that ends a stream that failed midway."""
    error = core_error_body(Protocol.OPENAI, exc)["error"]
    return _sse(stream.event("error", code=error["code"], message=error["message"], param=error["param"]))


def _sse(event: dict[str, Any]) -> str:
    return sse_event(event["type"], event)
