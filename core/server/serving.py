"""Machinery shared by the protocol routers: server state, the preamble of every generating route
(`start_route`: parse, check the model, request id, renamed fields, prepare and start), collecting
streams, watching for clients that leave, and SSE responses that clean up after themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from core.config import GenerationConfig
from core.engine import AsyncEngine
from core.errors import CoreError, InvalidRequestError, ModelNotFoundError
from core.request import REMOVED_HTTP_FIELDS, Inputs, PreparedRequest
from core.response import Response
from core.server.errors import renamed_fields, renamed_params, validation_to_core_error
from core.server.limits import ServerLimits
from core.server.metrics import Metrics, TrackedStream
from core.server.postprocess import Postprocessors
from core.server.sse import SSE_HEADERS
from core.stream import RequestStream, merge

log = logging.getLogger(__name__)
T = TypeVar("T")
Body = TypeVar("Body")
REQUEST_ID_HEADER = "X-Request-Id"
PARSE_OFF_LOOP_BYTES = 64 * 1024  # larger bodies are parsed on a thread, so the event loop runs on
Gate = Callable[[PreparedRequest], PreparedRequest]


@dataclass
class ServerState:
    """Everything a route needs, stored on `app.state.core`."""

    engine: AsyncEngine
    metrics: Metrics
    postprocessors: Postprocessors
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.engine.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use (the reported one first)."""
        return self.engine.model_names


def state_of(request: Request) -> ServerState:
    """The ServerState of the app serving `request`."""
    return request.app.state.core


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def parse_body(request: Request, model: type[T]) -> T:
    """The JSON body validated as `model`; malformed JSON or a wrong type is a 400 naming the field, a
    body over --max-request-bytes a 413 (before any parsing), a removed interactive-state field a 400
    naming it. A large body is parsed on a thread. A client that leaves while its body is read is
    `ClientDisconnected` (answered quietly), not an error of the server's."""
    try:
        raw = await state_of(request).limits.read_body(request.headers.get("content-length"), request.stream())
    except ClientDisconnect:
        raise ClientDisconnected() from None
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        parsed = await asyncio.to_thread(_validate_json, model, raw)
    else:
        parsed = _validate_json(model, raw)
    _reject_removed_fields(getattr(parsed, "model_extra", None) or {})
    return parsed


def _validate_json(model: type[T], raw: bytes) -> T:
    from pydantic import ValidationError

    try:
        return model.model_validate_json(raw or b"{}")  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise validation_to_core_error(exc.errors()) from None


def _reject_removed_fields(extra: dict[str, Any]) -> None:
    for name in extra:
        if name in REMOVED_HTTP_FIELDS:
            raise InvalidRequestError(
                f"{name} was removed: requests are stateless, so send the whole conversation with every "
                "request (prefix caching makes the repeat cheap)", param=name)


def check_model(state: ServerState, name: str | None) -> None:
    """A request naming another model is a 404 (no name, or any served name, means the served model; a
    loaded LoRA adapter's name, that adapter)."""
    if name is not None and name not in state.model_names and name not in state.engine.adapter_names():
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                                 param="model")


def with_adapter(state: ServerState, planned: Plan, model: str | None) -> Plan:
    """`planned` running through the LoRA adapter that `model` names (the base model's names: unchanged)."""
    if model is None or model in state.model_names:
        return planned
    return dataclasses.replace(planned, config=planned.config.replace(adapter=model))


def user_request_id(request: Request, body_id: str | None) -> str | None:
    """The client's request id (header X-Request-Id, else body request_id), used as the session id."""
    header = request.headers.get(REQUEST_ID_HEADER)
    chosen = header if header is not None else body_id
    if chosen is not None and not chosen:
        raise InvalidRequestError("request_id must not be empty", param="request_id")
    return chosen


def session_ids(request_id: str | None, count: int) -> list[str | None]:
    """Session ids for `count` prompts of one request: the user's id, suffixed -0, -1... for a list."""
    if request_id is None:
        return [None] * count
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


@dataclass(frozen=True)
class Plan:
    """What a route's body asks the engine for, in engine terms: one request per prompt.

    :param options: render options for `AsyncEngine.prepare` (tools, chat_template_kwargs, ...).
    :param field_names: engine field names -> the client's own, for errors raised while preparing
        (a translated message list: core.server.errors.renamed_fields).
    :param reasoning: the response is split by the reasoning parser (the chat routes), so a constraint
        applies after its reasoning section and special tokens stay in the text where a parser reads them
        (`Postprocessors.prepare`).
    """

    prompts: Sequence[Inputs]
    config: GenerationConfig
    options: Mapping[str, Any] = field(default_factory=dict)
    field_names: Mapping[str, str] = field(default_factory=dict)
    reasoning: bool = False


@dataclass(frozen=True)
class Started(Generic[Body]):
    """A route's requests once started: its parsed body and plan, the response id, and per prompt the
    prepared request and its stream, timed into the metrics (closing a source closes its stream).
    `model` is the name the response reports: the LoRA adapter's when the request named one."""

    body: Body
    plan: Plan
    response_id: str
    prepared: list[PreparedRequest]
    sources: list[TrackedStream]
    model: str


async def start_route(request: Request, body_type: type[Body], plan: Callable[[Body], Plan], *,
                      param_names: Mapping[str, str] | Callable[[Body], Mapping[str, str]], id_prefix: str,
                      body_request_id: Callable[[Body], str | None] = lambda body: None) -> Started[Body]:
    """Every generating route's preamble: parse the body, check the model, take the client's request id,
    translate the body into a `Plan` and start it, reporting errors under the protocol's own names."""
    state = state_of(request)
    body = await parse_body(request, body_type)
    check_model(state, getattr(body, "model", None))
    request_id = user_request_id(request, body_request_id(body))
    with renamed_params(param_names(body) if callable(param_names) else param_names):
        planned = with_adapter(state, plan(body), getattr(body, "model", None))
        with renamed_fields(planned.field_names):
            gate = state.postprocessors.prepare if planned.reasoning else None
            group = request_id if len(planned.prompts) > 1 else None  # /abort by the id reaches them all
            streams = await start_requests(request, planned.prompts, planned.config,
                                           session_ids(request_id, len(planned.prompts)), gate=gate,
                                           group=group, **planned.options)
    return Started(body, planned, f"{id_prefix}{request_id or uuid.uuid4().hex}", [s.prepared for s in streams],
                   [state.metrics.track(s) for s in streams], planned.config.adapter or state.model_name)


async def start_requests(request: Request, prompts: Sequence[Inputs], config: GenerationConfig,
                         session_ids: Sequence[str | None], *, gate: Gate | None = None,
                         **options: Any) -> list[RequestStream]:
    """One engine request per prompt, prepared off the event loop (AsyncEngine.prepare), then started
    (`gate`, when given, first adjusts each prepared request: a reasoning model's constraint).

    Past --max-queued-requests it is a 503 with Retry-After. If one prompt is rejected, the ones
    already started are dropped; a client that leaves meanwhile cancels them all, and they are counted
    as aborted in /metrics.
    """
    state = state_of(request)
    state.limits.admit(len(state.engine.sessions), len(prompts))
    started = time.perf_counter()
    try:
        starting = _start(state.engine, prompts, config, session_ids, gate, **options)
        return await until_disconnected(request, starting)
    except ClientDisconnected:
        for _ in prompts:
            state.metrics.finish("abort", 0, 0, started)
        raise


async def _start(engine: AsyncEngine, prompts: Sequence[Inputs], config: GenerationConfig,
                 session_ids: Sequence[str | None], gate: Gate | None, **options: Any) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for prompt, session_id in zip(prompts, session_ids, strict=True):
            prepared = await engine.prepare(prompt, config, session_id=session_id, **options)
            streams.append(engine.generate(gate(prepared) if gate is not None else prepared))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


async def collect_all(sources: Sequence[AsyncIterator[Any]]) -> list[Response]:
    """Whole responses of several requests run concurrently (one error cancels the others); every
    source is closed at the end, even one that never ran."""
    responses = [Response(index=i) for i in range(len(sources))]
    merged = merge(sources)
    try:
        async for i, output in merged:
            responses[i].add(output)
    finally:
        await merged.aclose()
        await close_all(sources)
    return responses


async def close_all(sources: Sequence[AsyncIterator[Any]]) -> None:
    """Close every source that can be closed (closing twice is harmless)."""
    for source in sources:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    # The body has been read, so the next message the server sends is http.disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


class EventStreamResponse(StreamingResponse):
    """An SSE response that notices a client leaving even between tokens, and always closes its source
    (which aborts the request and frees its KV blocks)."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None,
                 closing: Sequence[AsyncIterator[Any]] = ()) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._source = content
        self._closing = closing  # the requests' streams: closed even if the events never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                t.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self._source.aclose()  # type: ignore[attr-defined]
            await close_all(self._closing)
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            log.warning("streaming response failed: %r", results[0])


async def guarded_events(events: AsyncIterator[str], on_error: Callable[[CoreError], str],
                         done: str | None) -> AsyncIterator[str]:
    """Forward SSE events; an error mid-stream becomes one error event (then `done`, if any).

    Unexpected exceptions are logged with their traceback and reported without internals.
    """
    failure: CoreError | None = None
    try:
        async for event in events:
            yield event
    except CoreError as exc:
        failure = exc
    except Exception:
        log.exception("error while streaming a response")
        failure = CoreError("internal error while generating; see the server log")
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if failure is not None:
        yield on_error(failure)
    if done is not None:
        yield done
