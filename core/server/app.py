"""The FastAPI app factory: routers, error handlers and the API-key gate over one AsyncEngine."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from core import __version__
from core.engine import AsyncEngine
from core.server import adapters, admin, anthropic, embeddings, info, openai, responses, webui
from core.server.errors import error_body, install_error_handlers, protocol_of
from core.server.limits import ServerLimits
from core.server.metrics import Metrics
from core.server.openapi import openapi_document
from core.server.postprocess import Postprocessors
from core.server.serving import ClientDisconnected, ServerState

OPEN_PATHS = frozenset({"/health"})
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody receives it


class ApiKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streaming and disconnect detection are untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open = open_paths

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or ())
        bearer = headers.get(b"authorization", b"")
        candidates = [bearer[7:].strip() if bearer[:7].lower() == b"bearer " else b"", headers.get(b"x-api-key", b"")]
        return any(c and hmac.compare_digest(c, self._key) for c in candidates)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        body = error_body(protocol_of(scope), 401, "invalid or missing API key", code="invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


async def _on_client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def build_app(engine: AsyncEngine, *, api_key: str | None = None, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, metrics: Metrics | None = None, plugins: Any = None,
              limits: ServerLimits | None = None, web_ui: bool = True, **fastapi_options: Any) -> FastAPI:
    """An app serving `engine` over the OpenAI, Anthropic and admin routes.

    :param api_key: when set, required on every route except /health.
    :param reasoning_parser: name of a registered reasoning parser; "none" for no reasoning parsing; None
        for the automatic choice by the model's architecture and chat template.
    :param tool_call_parser: the same for tool-call parsers (used for requests that send tools).
    :param plugins: the PluginHost whose parsers are used (default: the process-wide one).
    :param limits: request-size and back-pressure limits (default: ServerLimits()).
    :param web_ui: serve the chat page at / (core.server.webui; open without the API key: it holds no data).
    :raises PluginError: when a parser name is not registered.
    """
    if plugins is None:
        from core.plugins import get_plugins

        plugins = get_plugins()
    postprocessors = Postprocessors.choose(plugins, engine, reasoning_parser, tool_call_parser)
    app = FastAPI(title="core", version=__version__, **fastapi_options)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    app.state.core = ServerState(engine=engine, metrics=metrics or Metrics(), postprocessors=postprocessors,
                                 api_key=api_key, limits=limits or ServerLimits())
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _on_client_disconnected)
    for router in (openai.router, responses.router, embeddings.router, anthropic.router, admin.router,
                   info.router, adapters.router):
        app.include_router(router)
    if web_ui:
        app.include_router(webui.router)
    if api_key:
        open_paths = OPEN_PATHS | webui.PATHS if web_ui else OPEN_PATHS
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    return app
