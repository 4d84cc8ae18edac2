"""Machinery shared by the protocol routers: server state, starting requests, merging and collecting
streams, watching for clients that leave, and SSE responses that clean up after themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from core.config import GenerationConfig
from core.engine import AsyncEngine, RequestStream
from core.errors import CoreError, InvalidRequestError, ModelNotFoundError
from core.request import REMOVED_HTTP_FIELDS, Inputs
from core.response import Response
from core.server.errors import validation_to_core_error
from core.server.limits import ServerLimits
from core.server.metrics import Metrics
from core.server.postprocess import Postprocessors
from core.server.sse import SSE_HEADERS

log = logging.getLogger(__name__)
T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"
PARSE_OFF_LOOP_BYTES = 64 * 1024  # larger bodies are parsed on a thread, so the event loop runs on


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
    naming it. A large body is parsed on a thread."""
    raw = await state_of(request).limits.read_body(request.headers.get("content-length"), request.stream())
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
    """A request naming another model is a 404 (no name, or any served name, means the served model)."""
    if name is not None and name not in state.model_names:
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                                 param="model")


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


async def start_requests(request: Request, prompts: Sequence[Inputs], config: GenerationConfig,
                         session_ids: Sequence[str | None], **options: Any) -> list[RequestStream]:
    """One engine request per prompt, prepared off the event loop (AsyncEngine.generate_async).

    Past --max-queued-requests it is a 503 with Retry-After. If one prompt is rejected, the ones
    already started are dropped; a client that leaves meanwhile cancels them all, and they are counted
    as aborted in /metrics.
    """
    state = state_of(request)
    state.limits.admit(len(state.engine.sessions), len(prompts))
    started = time.perf_counter()
    try:
        starting = _start(state.engine, prompts, config, session_ids, **options)
        return await until_disconnected(request, starting)
    except ClientDisconnected:
        for _ in prompts:
            state.metrics.finish("abort", 0, 0, started)
        raise


async def _start(engine: AsyncEngine, prompts: Sequence[Inputs], config: GenerationConfig,
                 session_ids: Sequence[str | None], **options: Any) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for prompt, session_id in zip(prompts, session_ids, strict=True):
            streams.append(await engine.generate_async(prompt, config, session_id=session_id, **options))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


async def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they arrive, tagged with the iterator's index.

    Closing the merged iterator (or an error in any source) cancels every source, which closes them.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((i, item, None, False))
        except Exception as exc:
            queue.put_nowait((i, None, exc, True))
            return
        queue.put_nowait((i, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error, ended = await queue.get()
            if error is not None:
                raise error
            if ended:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
