"""One place that turns errors into each protocol's error body.

Every failure a client can cause (a CoreError from the engine or the config, a malformed body, a wrong
type) becomes a 4xx in the protocol of the route it hit: OpenAI's `{"error": {message, type, param,
code}}` or Anthropic's `{"type": "error", "error": {type, message}}`. Anything unexpected becomes a
generic 500 whose body carries no internals; the traceback goes to the log.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import CoreError, ErrorCode, InvalidRequestError

log = logging.getLogger(__name__)

ANTHROPIC_PREFIX = "/v1/messages"
MODELS_PREFIX = "/v1/models"
GENERIC_500 = "The server had an internal error while processing the request; see the server log."

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                500: "internal_error", 503: "service_unavailable_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large",
                   500: "api_error", 503: "overloaded_error"}
# OpenAI's own `code` where it has one (clients check context_length_exceeded to truncate and retry).
OPENAI_CODES = {ErrorCode.CONTEXT_TOO_LONG: "context_length_exceeded"}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class Protocol(enum.Enum):
    """The error dialect of a route."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def protocol_of(scope: Scope) -> Protocol:
    """Anthropic routes live under /v1/messages; /v1/models, which both APIs have, speaks Anthropic's dialect to a
    request with an `anthropic-version` header (Anthropic's clients send one with every request); every other route
    speaks OpenAI's."""
    path = scope["path"]
    if path.startswith(ANTHROPIC_PREFIX):
        return Protocol.ANTHROPIC
    if path.startswith(MODELS_PREFIX) and any(name == b"anthropic-version" for name, _ in scope.get("headers", ())):
        return Protocol.ANTHROPIC
    return Protocol.OPENAI


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(protocol: Protocol, status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error body of `protocol`."""
    if protocol is Protocol.ANTHROPIC:
        return anthropic_error(status, message)
    return openai_error(status, message, param=param, code=code)


def core_error_body(protocol: Protocol, exc: CoreError) -> dict[str, Any]:
    """The body for a CoreError: its message, its `param`, its code's name."""
    message = exc.message if exc.code is not ErrorCode.INTERNAL else GENERIC_500
    code = OPENAI_CODES.get(exc.code, exc.code.type_name)
    return error_body(protocol, exc.http_status, message, param=exc.param, code=code)


def error_response(protocol: Protocol, exc: CoreError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSON response for a CoreError (with Retry-After when the error knows when to retry)."""
    retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    return JSONResponse(core_error_body(protocol, exc), status_code=exc.http_status,
                        headers={**retry, **(headers or {})})


# -- validation errors -----------------------------------------------------------------------------


def _is_type_tag(part: Any) -> bool:
    # pydantic names the union member that failed inside `loc`; users know only the field names.
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function"))


def param_of(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """A dotted field path (messages.0.role) from a pydantic error location, without union tags."""
    parts = [str(p) for p in loc if not _is_type_tag(p) and p != "body"]
    return ".".join(parts) or None


def validation_to_core_error(errors: list[Mapping[str, Any]]) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming its field."""
    if not errors:
        return InvalidRequestError("the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the request body is not valid JSON ({first.get('msg')})", param="body")
    param = param_of(first.get("loc", ()))
    if param is None:  # the body itself (a list, a number) is not an object
        return InvalidRequestError("the request body must be a JSON object", param="body")
    return InvalidRequestError(f"{param}: {first.get('msg')}", param=param)


@contextmanager
def renamed_params(names: Mapping[str, str]) -> Iterator[None]:
    """Report engine field names (max_new_tokens) as the protocol's own names (max_tokens)."""
    try:
        yield
    except CoreError as exc:
        if exc.param in names:
            for engine_name, protocol_name in names.items():
                exc.message = exc.message.replace(engine_name, protocol_name)
            exc.param = names[exc.param]
        raise


@contextmanager
def renamed_fields(prefixes: Mapping[str, str]) -> Iterator[None]:
    """Report fields of a translated request (``messages[1].content[0]``, after a system prompt was put
    first) under the client's own names (``messages[0].content[0]``); the longest matching prefix wins."""
    try:
        yield
    except CoreError as exc:
        param = exc.param or ""
        matches = [p for p in prefixes if param == p or param.startswith((p + ".", p + "["))]
        if matches:
            old = max(matches, key=len)
            exc.message = exc.message.replace(old, prefixes[old], 1)
            exc.param = prefixes[old] + param[len(old):]
        raise


# -- handlers --------------------------------------------------------------------------------------


async def _on_core_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CoreError)
    if exc.code is ErrorCode.INTERNAL:  # its body says "see the server log": the log says which request and why
        log.error("internal error on %s %s: %s", request.method, request.url.path, exc)
    return error_response(protocol_of(request.scope), exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, (RequestValidationError, ValidationError)) else []
    return error_response(protocol_of(request.scope), validation_to_core_error(list(errors)))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    body = error_body(protocol_of(request.scope), exc.status_code, str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


class UnexpectedErrorMiddleware:
    """An unexpected exception becomes the generic 500 of the route's protocol, logged with its traceback
    and not raised further. (Starlette's own handler for Exception re-raises after answering, and uvicorn
    then closes the connection: the client's next request on that keep-alive connection met a reset.) An
    exception after the response started is raised on: only closing the connection can tell the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error on %s %s", scope.get("method"), scope["path"], exc_info=exc)
            body = error_body(protocol_of(scope), 500, GENERIC_500, code="internal")
            await JSONResponse(body, status_code=500)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through this module so no input produces a stack trace."""
    app.add_exception_handler(CoreError, _on_core_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_middleware(UnexpectedErrorMiddleware)
