"""One error vocabulary for the whole stack: ErrorCode -> HTTP status, and the engine's exceptions.

Every layer raises a `CoreError` subclass; the server maps `code` to a status and renders `message`
in its protocol's error shape. Messages are written for users: they name the field and the bad value and
never carry internals such as tracebacks.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Machine-readable error kinds and the HTTP status each one maps to."""

    INVALID_REQUEST = 400
    CONTEXT_TOO_LONG = 400
    UNSUPPORTED = 400
    UNAUTHORIZED = 401
    MODEL_NOT_FOUND = 404
    REQUEST_NOT_FOUND = 404
    CONFLICT = 409
    REQUEST_TOO_LARGE = 413
    UNAVAILABLE = 503
    SLEEPING = 503
    OVERLOADED = 503
    INTERNAL = 500

    # Two members share a status, so Enum would alias them; a per-member tag keeps them distinct.
    def __new__(cls, status: int) -> ErrorCode:
        member = object.__new__(cls)
        member._value_ = f"{status}:{len(cls.__members__)}"
        member.http_status = status
        return member

    @property
    def type_name(self) -> str:
        """Lower-case name used as the `type`/`code` field of error bodies."""
        return self.name.lower()


class CoreError(Exception):
    """Base of every error the engine reports to callers.

    :param message: user-facing text.
    :param param: the request field at fault, when there is one.
    """

    code: ErrorCode = ErrorCode.INTERNAL
    #: Seconds after which a retry may succeed (sent as the Retry-After header), when that is known.
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def http_status(self) -> int:
        return self.code.http_status


class InvalidRequestError(CoreError, ValueError):
    """The request is malformed or a value is out of range."""

    code = ErrorCode.INVALID_REQUEST


class ContextTooLongError(InvalidRequestError):
    """The prompt (plus max_new_tokens' minimum) does not fit the model's context window."""

    code = ErrorCode.CONTEXT_TOO_LONG


class UnsupportedError(CoreError):
    """A valid feature this model or backend does not support."""

    code = ErrorCode.UNSUPPORTED


class SessionConflictError(CoreError):
    """A user-given session id is already in flight."""

    code = ErrorCode.CONFLICT


class AdapterInUseError(CoreError):
    """An adapter cannot be unloaded while requests run through it (retry when they end)."""

    code = ErrorCode.CONFLICT


class ModelNotFoundError(CoreError):
    """The request names a model this server does not serve."""

    code = ErrorCode.MODEL_NOT_FOUND


class RequestNotFoundError(CoreError):
    """The request id names no request in flight (e.g. /abort of one that already ended)."""

    code = ErrorCode.REQUEST_NOT_FOUND


class RequestTooLargeError(CoreError):
    """The request body is larger than the server accepts."""

    code = ErrorCode.REQUEST_TOO_LARGE


class OverloadedError(CoreError):
    """The server already holds as many requests as it queues; retry after `retry_after_s` seconds."""

    code = ErrorCode.OVERLOADED

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineSleepingError(CoreError):
    """The engine is asleep: its weights and/or KV cache are released."""

    code = ErrorCode.SLEEPING

    def __init__(self, asleep: frozenset[str] | set[str] = frozenset()) -> None:
        tags = "&".join(f"tags={t}" for t in sorted(asleep)) or "tags=weights&tags=kv_cache"
        super().__init__(
            "The engine is sleeping (its memory is released). "
            f"Wake it with POST /wakeup?{tags} or AsyncEngine.wakeup()."
        )
        self.asleep = frozenset(asleep)


class EngineUnavailableError(CoreError):
    """The engine cannot serve: it has died or is shutting down."""

    code = ErrorCode.UNAVAILABLE


class BackendError(CoreError):
    """A backend failed while serving a request (e.g. its KV cache was gone)."""

    code = ErrorCode.INTERNAL


class PluginError(Exception):
    """A plugin is misbehaving: a conflict, a misspelt hook, a bad registration."""
