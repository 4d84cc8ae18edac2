"""OpenAI-compatible routes: /v1/models (in Anthropic's shape to Anthropic's clients), /v1/chat/completions,
/v1/completions.

Routes are thin: parse and check the body, translate it (openai_translate), start engine requests, and
either stream SSE chunks or collect whole responses while watching for the client leaving.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from core.adapters import AdapterInfo
from core.errors import CoreError
from core.parsers import ToolCallFormat
from core.request import RequestOutput
from core.response import Response as EngineResponse
from core.server import openai_translate as tr
from core.server.errors import Protocol, core_error_body, protocol_of
from core.server.openai_protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from core.server.postprocess import ChatPostprocessor
from core.server.serving import (
    EventStreamResponse,
    Plan,
    ServerState,
    check_model,
    collect_all,
    guarded_events,
    start_route,
    state_of,
    until_disconnected,
)
from core.server.sse import DONE, sse_data
from core.stream import merge

router = APIRouter()
STARTED = int(time.time())


def openai_error_event(exc: CoreError) -> str:
    """The SSE event that reports an error in the middle of a stream."""
    return sse_data(core_error_body(Protocol.OPENAI, exc))


def _stream(events: AsyncIterator[str], request_id: str, sources: Sequence[AsyncIterator[Any]]) -> EventStreamResponse:
    return EventStreamResponse(guarded_events(events, openai_error_event, DONE), headers={"X-Request-Id": request_id},
                               closing=sources)


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    """The `model` object of one served name (every name is the same model: `root` is the reported one)."""
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "core", "root": state.model_name,
            "max_model_len": state.engine.model_info.max_model_len}


def anthropic_model_card(name: str) -> dict[str, Any]:
    """Anthropic's `ModelInfo` of one served name (or adapter)."""
    created = datetime.datetime.fromtimestamp(STARTED, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": created}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The model this server serves, once under each of its names (and each loaded adapter); in Anthropic's
    shape (one page: `has_more` false) to a request with an `anthropic-version` header."""
    state = state_of(request)
    adapters = state.engine.backend.adapters()
    if protocol_of(request.scope) is Protocol.ANTHROPIC:
        names = list(state.model_names) + [a.name for a in adapters]
        return {"data": [anthropic_model_card(n) for n in names], "has_more": False, "first_id": names[0],
                "last_id": names[-1]}
    cards = [model_card(state, name) for name in state.model_names]
    return {"object": "list", "data": cards + [adapter_card(state, a) for a in adapters]}


def adapter_card(state: ServerState, adapter: AdapterInfo) -> dict[str, Any]:
    """A LoRA adapter's `model` object (vLLM's shape: `root` its folder, `parent` the base model)."""
    return {"id": adapter.name, "object": "model", "created": STARTED, "owned_by": "core", "root": adapter.path,
            "parent": state.model_name, "max_model_len": state.engine.model_info.max_model_len}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """One model by name; a 404 for a name this server does not serve."""
    state = state_of(request)
    check_model(state, model_id)
    if protocol_of(request.scope) is Protocol.ANTHROPIC:
        return anthropic_model_card(model_id)
    return model_card(state, model_id)


# -- chat ------------------------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """Chat completion over the model's chat template (streamed as SSE when `stream` is true)."""
    state = state_of(request)
    started = await start_route(request, ChatCompletionRequest,
                                lambda req: chat_plan(req, state.postprocessors.tool_call_format),
                                param_names=tr.chat_param_names, id_prefix="chatcmpl-",
                                body_request_id=lambda req: req.request_id)
    req, response_id, [source] = started.body, started.response_id, started.sources
    post = state.postprocessors.for_prepared(started.prepared[0], req.parallel_tool_calls is not False)
    calls = tr.reports_tool_calls(req)
    if req.stream:
        events = _chat_events(state, response_id, started.model, source, post, req.stream_options, calls)
        return _stream(events, response_id, [source])
    [result] = await until_disconnected(request, collect_all([source]))
    return JSONResponse(chat_response(state, response_id, started.model, result, post, calls),
                        headers={"X-Request-Id": response_id})


def chat_plan(req: ChatCompletionRequest, call_format: ToolCallFormat | None = None) -> Plan:
    """What a chat request asks the engine for (also what a Responses request runs as); `call_format`
    is the tool-call parser's, which a forced tool_choice is generated in (None: the bare JSON object that
    core.forced_tool_call reads)."""
    tools = tr.check_tool_choice(req)
    tr.check_template_fields(req)
    tr.check_text_output(req)
    config = tr.chat_generation_config(req, tr.forced_tool_call(req, tools, call_format))
    return Plan([req.messages], config, {"tools": tools, "chat_template_kwargs": tr.chat_template_kwargs(req),
                                         "add_generation_prompt": req.add_generation_prompt}, reasoning=True)


def chat_response(state: ServerState, response_id: str, model: str, result: EngineResponse,
                  post: ChatPostprocessor, calls: bool = True) -> dict[str, Any]:
    """A whole `chat.completion` object; `calls`: a choice that called tools finishes "tool_calls"
    (`openai_translate.reports_tool_calls`)."""
    choices = []
    for c in result.choices:
        parts = post.final(c.text)
        finish = tr.finish_reason(c.finish_reason, tool_calls=calls and bool(parts.tool_calls))
        choices.append({"index": c.index, "message": tr.chat_message(parts),
                        "logprobs": tr.chat_logprobs(c.logprobs, state.engine.detokenize), "finish_reason": finish,
                        "stop_reason": c.stop_reason})
    response = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": tr.usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}
    if result.prompt_logprobs is not None:
        response["prompt_logprobs"] = tr.vllm_prompt_logprobs(result.prompt_logprobs, state.engine.detokenize)
    return response


async def _chat_events(state: ServerState, response_id: str, model: str, source: AsyncIterator[RequestOutput],
                       post: ChatPostprocessor, options: StreamOptions | None, calls: bool) -> AsyncIterator[str]:
    created = int(time.time())
    started: set[int] = set()
    totals = _Totals(options)

    def chunk(choice: dict[str, Any]) -> str:
        return sse_data(tr.chat_chunk(response_id, created, model, [choice], totals.running()))

    async for out in source:
        if out.index not in started:
            started.add(out.index)
            totals.add(0, dataclasses.replace(out, completion_tokens=0))
            yield chunk(tr.chat_delta_choice(out.index, {"role": "assistant", "content": ""}))
        totals.add(0, out)
        deltas = tr.chat_deltas(post.delta(out.index, out.text, finished=out.finish_reason is not None))
        finish = tr.finish_reason(out.finish_reason, tool_calls=calls and post.called_tools(out.index))
        logprobs = tr.chat_logprobs(out.logprobs, state.engine.detokenize)
        for delta in deltas[:-1]:
            yield chunk(tr.chat_delta_choice(out.index, delta))
        last = deltas[-1] if deltas else {}
        if last or finish or logprobs:
            yield chunk(tr.chat_delta_choice(out.index, last, finish, logprobs))
    if totals.include:
        yield sse_data(tr.chat_chunk(response_id, created, model, [], totals.usage()))


class _Totals:
    """Token counts of a streamed response: prompt tokens per request, completion tokens per choice; whether
    the stream ends with them (`include`) and puts them so far on every chunk (`running`), as `options` ask."""

    def __init__(self, options: StreamOptions | None) -> None:
        self.include = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous)
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, request_index: int, out: RequestOutput) -> None:
        self.prompt[request_index] = out.prompt_tokens
        self.cached[request_index] = out.cached_tokens
        self.completion[request_index, out.index] = out.completion_tokens

    def usage(self) -> dict[str, Any]:
        return tr.usage(sum(self.prompt.values()), sum(self.completion.values()), sum(self.cached.values()))

    def running(self) -> dict[str, Any] | None:
        """The usage so far for a chunk: only with continuous usage stats."""
        return self.usage() if self.continuous else None


# -- completions -----------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """Text completion; a list prompt runs one independent request per item."""
    state = state_of(request)
    started = await start_route(request, CompletionRequest, _completion_plan, param_names=tr.COMPLETION_PARAM_NAMES,
                                id_prefix="cmpl-", body_request_id=lambda req: req.request_id)
    req, response_id, sources, config = started.body, started.response_id, started.sources, started.plan.config
    prompts, decode = started.plan.prompts, state.engine.detokenize
    echoes = [tr.completion_echo(req, p, prepared.prompt_token_ids, decode)
              for p, prepared in zip(prompts, started.prepared, strict=True)]
    if req.stream:
        events = _completion_events(state, response_id, started.model, sources, config.n, echoes,
                                    req.stream_options)
        return _stream(events, response_id, sources)
    results = await until_disconnected(request, collect_all(sources))
    body = completion_response(state, response_id, started.model, results, config.n, echoes,
                               req.prompt_logprobs is not None)
    return JSONResponse(body, headers={"X-Request-Id": response_id})


def _completion_plan(req: CompletionRequest) -> Plan:
    return Plan(tr.completion_prompts(req.prompt), tr.completion_generation_config(req))


def completion_response(state: ServerState, response_id: str, model: str, results: Sequence[EngineResponse], n: int,
                        echoes: Sequence[tr.Echo], prompt_logprobs: bool = False) -> dict[str, Any]:
    """A whole `text_completion` object; choice index = prompt index * n + choice index. Each choice
    repeats its prompt as `echoes[prompt index]` says, and with `prompt_logprobs` carries vLLM's."""
    decode, choices = state.engine.detokenize, []
    for r in results:
        echo = echoes[r.index]
        for c in r.choices:
            choice = tr.completion_choice(r.index * n + c.index, echo.choice_text(c.text),
                                          "length" if echo.prompt_only else tr.finish_reason(c.finish_reason),
                                          echo.choice_logprobs(r.prompt_logprobs, c.logprobs, decode))
            if prompt_logprobs:
                choice["prompt_logprobs"] = tr.vllm_prompt_logprobs(r.prompt_logprobs, decode)
            choices.append(choice)
    generated = sum(0 if echoes[r.index].prompt_only else r.completion_tokens for r in results)
    return {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": tr.usage(sum(r.prompt_tokens for r in results), generated, sum(r.cached_tokens for r in results))}


async def _completion_events(state: ServerState, response_id: str, model: str,
                             sources: Sequence[AsyncIterator[RequestOutput]], n: int, echoes: Sequence[tr.Echo],
                             options: StreamOptions | None) -> AsyncIterator[str]:
    created, decode = int(time.time()), state.engine.detokenize
    offsets: dict[int, int] = {}  # text streamed so far per choice
    prompts: dict[int, Any] = {}  # prompt logprobs per request (its first output carries them)
    totals = _Totals(options)
    async for i, out in merge(sources):
        index = i * n + out.index
        echo, first = echoes[i], index not in offsets
        if out.prompt_logprobs is not None:
            prompts[i] = out.prompt_logprobs
        text = echo.choice_text(out.text, first)
        logprobs = echo.choice_logprobs(prompts.get(i), out.logprobs, decode, offsets.get(index, 0), first)
        offsets[index] = offsets.get(index, 0) + len(text)
        finish = "length" if echo.prompt_only and out.finish_reason else tr.finish_reason(out.finish_reason)
        choice = tr.completion_choice(index, text, finish, logprobs)
        totals.add(i, dataclasses.replace(out, completion_tokens=0) if echo.prompt_only else out)
        yield sse_data(tr.completion_chunk(response_id, created, model, [choice], totals.running()))
    if totals.include:
        yield sse_data(tr.completion_chunk(response_id, created, model, [], totals.usage()))
