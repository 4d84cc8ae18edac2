"""SessionManager: ids, conflicts, stale objects, epochs, abort and close."""

from __future__ import annotations

import pytest

from core.backend import EndResult
from core.errors import InvalidRequestError, SessionConflictError
from core.session import SessionManager, SessionState
from core.testing.fake import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def manager(backend) -> SessionManager:
    return SessionManager(backend)


def test_automatic_ids_are_unique(manager):
    ids = {manager.create().id for _ in range(100)}
    assert len(ids) == 100 and len(manager) == 100


def test_user_id_in_flight_is_a_conflict(manager):
    manager.create("mine")
    with pytest.raises(SessionConflictError, match="mine"):
        manager.create("mine")


@pytest.mark.parametrize("bad", ["", 5, "x" * 300])
def test_bad_user_ids(manager, bad):
    with pytest.raises(InvalidRequestError, match="session_id"):
        manager.create(bad)


def test_removing_a_stale_object_keeps_the_new_session(manager):
    old = manager.create("reused")
    assert manager.remove(old)
    new = manager.create("reused")
    assert not manager.remove(old)
    assert manager.get("reused") is new


async def test_close_awaits_the_backends_confirmation(manager, backend):
    session = manager.create()
    assert await manager.close(session) is EndResult.NOT_FOUND  # never reached the backend
    assert backend.count("end", session.id) == 0
    session = manager.create()
    session.reached_backend = True
    backend._known.add(session.id)
    assert await manager.close(session) is EndResult.ENDED
    assert await manager.close(session) is EndResult.ENDED  # idempotent: the backend is asked once
    assert backend.count("end", session.id) == 1 and len(manager) == 0


async def test_end_of_an_unknown_session_is_not_found(backend):
    assert await backend.end("nobody") is EndResult.NOT_FOUND


async def test_abort_reaches_the_backend_at_most_once(manager, backend):
    session = manager.create()
    session.reached_backend = True
    await manager.abort(session)
    await manager.abort(session)
    assert backend.count("abort", session.id) == 1 and session.state is SessionState.ABORTED


async def test_stop_all_bumps_the_epoch_and_aborts_everything(manager):
    first, second = manager.create(), manager.create()
    assert await manager.stop_all() == 2
    assert manager.is_stale(first) and manager.is_stale(second)
    assert first.state is SessionState.ABORTED
    assert not manager.is_stale(manager.create())
    assert not await manager.abort_id("missing")


async def test_abort_all_is_one_backend_call(manager, backend):
    sessions = [manager.create() for _ in range(16)]
    for session in sessions[:12]:
        session.reached_backend = True
    assert await manager.abort_all() == 16
    assert await manager.abort_all() == 16  # nothing is sent twice
    assert backend.count("abort_many", "") == 1
    assert [backend.count("abort", s.id) for s in sessions] == [1] * 12 + [0] * 4
    assert all(s.state is SessionState.ABORTED for s in sessions)
