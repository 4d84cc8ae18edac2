"""What one client may ask of the server: the size of a request body and how many generation requests
the server holds at once (back-pressure), with the errors that say so (413; 503 with Retry-After)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequestError, OverloadedError, RequestTooLargeError

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# A body over the limit is still read (and dropped) up to this many times the limit, so that a client
# still sending it receives the 413 instead of a reset connection; past it the connection is dropped.
DRAIN_FACTOR = 8
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits (flags --max-request-bytes and --max-queued-requests).

    :param max_request_bytes: the largest request body; a larger one is a 413 before it is parsed.
    :param max_queued_requests: the most generation requests held at once, from arrival to their last
        token (preparing, waiting or running; each prompt of a completions list counts); past it new
        ones get a 503 with Retry-After, so a burst cannot grow memory without bound.
    """

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_queued_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)

    @classmethod
    def from_args(cls, args: Any) -> ServerLimits:
        """From `core serve`'s flags (a namespace without them gets the defaults)."""
        return cls(getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
                   getattr(args, "max_queued_requests", DEFAULT_MAX_QUEUED_REQUESTS))

    def too_large(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"the request body is larger than this server's limit of "
                                    f"{self.max_request_bytes} bytes (--max-request-bytes)", param="body")

    async def read_body(self, declared_length: str | None, chunks: AsyncIterator[bytes]) -> bytes:
        """The whole body, or RequestTooLargeError once it passes the limit (told by Content-Length or
        counted while reading)."""
        limit = self.max_request_bytes
        declared = int(declared_length) if declared_length is not None and declared_length.isdigit() else None
        if declared is not None and declared > limit * DRAIN_FACTOR:
            raise self.too_large()
        over = declared is not None and declared > limit
        kept: list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            over = over or size > limit
            if size > limit * DRAIN_FACTOR:
                break
            if not over:
                kept.append(chunk)
        if over:
            raise self.too_large()
        return b"".join(kept)

    def admit(self, held: int, count: int) -> None:
        """Raise OverloadedError when `count` more requests would pass the limit (`held` are in), or
        InvalidRequestError (naming `prompt`, a completions list) when they never could: a retry cannot help."""
        if count > self.max_queued_requests:
            raise InvalidRequestError(
                f"the request holds {count} prompts, more than this server's limit of {self.max_queued_requests} "
                "requests held at once (--max-queued-requests); send them in smaller requests", param="prompt")
        if held + count > self.max_queued_requests:
            raise OverloadedError(
                f"the server is at its limit of {self.max_queued_requests} queued requests "
                f"(--max-queued-requests); retry in {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S)
