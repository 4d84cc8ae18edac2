"""ASGI middlewares of a Ray Serve replica's app: the replica's name on every response, and a deadline on
a request body that never comes.

Ray Serve's proxy hands a request's body to the first replica that asks for it, once. When a replica
dies just after accepting a request, before the proxy has heard that it accepted, the proxy's router
sends the request again to another replica (Ray 2.60, `Router._route_and_send_request_once`), whose
app then waits for a body that is already gone, until the client gives up. `BodyDeadlineMiddleware`
turns that wait into a 503 the client can retry: a body message (while more of the body is due) that
does not arrive within `BODY_WAIT_S` fails the request. Ray's proxy reads the client's body as it comes,
so a live client's body is in the proxy's queue long before that.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import EngineUnavailableError

REPLICA_HEADER = "X-Core-Replica"
BODY_WAIT_S = 10.0


class ReplicaHeaderMiddleware:
    """Adds `X-Core-Replica: ID` to every HTTP response (a plain ASGI middleware: streams pass untouched)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.lower().encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_named)


class BodyDeadlineMiddleware:
    """Fails a request (503, in the route's protocol) whose next body message does not come within
    `wait_s`; once the body is complete, `receive` (a wait for the client's disconnect) is not timed."""

    def __init__(self, app: ASGIApp, wait_s: float = BODY_WAIT_S) -> None:
        self.app = app
        self._wait_s = wait_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_due = True

        async def receive_in_time() -> Message:
            nonlocal body_due
            if not body_due:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self._wait_s)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
                raise EngineUnavailableError(
                    f"the request body did not reach this replica within {self._wait_s:g} s (the replica first "
                    "chosen for it may have died); retry the request") from None
            body_due = message["type"] == "http.request" and message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
