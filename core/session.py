"""Sessions: the handle of one in-flight request, and the table that tracks them.

A Session has an id (generated, or given by the user), the engine epoch it was created in, and flags that
make cleanup idempotent: the backend is asked to abort at most once and to end exactly once. `stop_all`
starts a new epoch; work stamped with an older epoch is answered "abort" before it reaches the backend.
"""

from __future__ import annotations

import enum
import itertools
import uuid
from dataclasses import dataclass, field

from core.backend import Backend, EndResult
from core.errors import InvalidRequestError, SessionConflictError

MAX_SESSION_ID_LENGTH = 256


class SessionState(enum.Enum):
    """Where a session is in its life."""

    PENDING = "pending"  # created, not yet handed to the backend
    RUNNING = "running"  # the backend is generating for it
    FINISHED = "finished"  # ended normally, failed, or aborted
    ABORTED = "aborted"  # abort was requested


@dataclass(eq=False)
class Session:
    """One request's handle. Identity matters: a stale object never affects a newer session that
    reused its id."""

    id: str
    epoch: int
    user_given: bool = False
    group: str | None = None  # the client's id of a request of several prompts, one session each
    state: SessionState = SessionState.PENDING
    reached_backend: bool = False
    abort_sent: bool = False
    end_result: EndResult | None = field(default=None)

    @property
    def ended(self) -> bool:
        return self.end_result is not None


class SessionManager:
    """Creates, finds, aborts and closes sessions for one backend."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._sessions: dict[str, Session] = {}
        self._counter = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def ids(self) -> list[str]:
        return list(self._sessions)

    def create(self, session_id: str | None = None, group: str | None = None) -> Session:
        """A new session stamped with the current epoch; a user id already in flight is a conflict. `group`
        names the request it is one prompt of, so that aborting that id reaches it (`abort_id`)."""
        if session_id is None:
            session = Session(f"req-{self._prefix}-{next(self._counter)}", self.epoch)
        else:
            _validate_session_id(session_id)
            if session_id in self._sessions:
                raise SessionConflictError(f"session id {session_id!r} is already in flight", param="session_id")
            session = Session(session_id, self.epoch, user_given=True, group=group)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def is_stale(self, session: Session) -> bool:
        """True when stop_all ran after the session was stamped."""
        return session.epoch != self.epoch

    def is_dropped(self, session: Session) -> bool:
        """True when the session must not reach the backend: aborted, or stamped before a stop_all."""
        return self.is_stale(session) or session.state is SessionState.ABORTED

    def mark_running(self, session: Session) -> None:
        """The session is handed to the backend now: from here on aborting and ending it reach the backend."""
        session.reached_backend, session.state = True, SessionState.RUNNING

    def remove(self, session: Session) -> bool:
        """Forget `session`; a stale object whose id now belongs to another session is a no-op."""
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            return True
        return False

    async def abort(self, session: Session) -> None:
        """Mark aborted and, if the backend has it, ask the backend to stop (at most once)."""
        if self._mark_aborted(session):
            await self._backend.abort(session.id)

    def _mark_aborted(self, session: Session) -> bool:
        """Mark `session` aborted; True when the backend still has to be told (once per session)."""
        if session.state is not SessionState.FINISHED:
            session.state = SessionState.ABORTED
        if session.reached_backend and not session.abort_sent and not session.ended:
            session.abort_sent = True
            return True
        return False

    async def abort_id(self, session_id: str) -> int:
        """Abort the session with this id, else every session of the group of that id (a request of several
        prompts); how many (0: none is in flight)."""
        session = self._sessions.get(session_id)
        if session is not None:
            await self.abort(session)
            return 1
        return await self._abort_many([s for s in self._sessions.values() if s.group == session_id])

    async def abort_all(self) -> int:
        """Abort every session in flight, in one backend call (`Backend.abort_many`); returns how many."""
        return await self._abort_many(list(self._sessions.values()))

    async def _abort_many(self, sessions: list[Session]) -> int:
        to_backend = [session.id for session in sessions if self._mark_aborted(session)]
        if to_backend:
            await self._backend.abort_many(to_backend)
        return len(sessions)

    async def stop_all(self) -> int:
        """Start a new epoch and abort everything in flight."""
        self.epoch += 1
        return await self.abort_all()

    async def close(self, session: Session) -> EndResult:
        """Remove the session and await the backend's confirmation that it ended (exactly once)."""
        self.remove(session)
        session.state = SessionState.FINISHED
        if session.end_result is None:
            if session.reached_backend:
                session.end_result = await self._backend.end(session.id)
            else:
                session.end_result = EndResult.NOT_FOUND
        return session.end_result


def _validate_session_id(session_id: object) -> None:
    if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidRequestError(
            f"session_id must be a non-empty string of at most {MAX_SESSION_ID_LENGTH} characters, "
            f"got {session_id!r}",
            param="session_id",
        )
