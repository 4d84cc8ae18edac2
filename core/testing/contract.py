"""The backend contract suite: behaviour every backend must show, as a reusable pytest class.

A backend proves itself with a few lines in its own test module::

    from core.testing.contract import BackendContractTests

    class TestMyBackendContract(BackendContractTests):
        @pytest.fixture
        async def backend(self):
            backend = MyBackend(...)          # a small model is enough
            yield backend
            await backend.close()

The suite drives the backend through AsyncEngine with token-id prompts (so no chat template is needed)
and wraps it in a spy that counts calls. A subclass may override `prompt_token_ids`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest

from core.backend import Backend, BackendOutput, BackendStats, EndResult, GenerateRequest
from core.config import GenerationConfig
from core.engine import AsyncEngine
from core.errors import (
    ContextTooLongError,
    EngineSleepingError,
    ErrorCode,
    InvalidRequestError,
    SessionConflictError,
    UnsupportedError,
)
from core.request import REMOVED_KEYWORDS
from core.response import Response, collect

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)


class SpyBackend(Backend):
    """Delegates to a real backend and counts generate/abort/end calls per session (and batched aborts
    as ("abort_many", ""))."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.model_info = inner.model_info
        self.tokenizer = inner.tokenizer
        self.supports_prompt_logprobs = inner.supports_prompt_logprobs
        self.calls: Counter[tuple[str, str]] = Counter()
        self.requests: list[GenerateRequest] = []

    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        self.calls["generate", request.session_id] += 1
        self.requests.append(request)
        return self.inner.generate(request)

    async def abort(self, session_id: str) -> None:
        self.calls["abort", session_id] += 1
        await self.inner.abort(session_id)

    async def abort_many(self, session_ids: Sequence[str]) -> None:
        self.calls["abort_many", ""] += 1
        for session_id in session_ids:
            self.calls["abort", session_id] += 1
        await self.inner.abort_many(session_ids)

    async def end(self, session_id: str) -> EndResult:
        self.calls["end", session_id] += 1
        return await self.inner.end(session_id)

    async def sleep(self, level: int) -> None:
        await self.inner.sleep(level)

    async def wakeup(self, tags: Sequence[str]) -> None:
        await self.inner.wakeup(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.inner.is_sleeping

    def stats(self) -> BackendStats:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> BackendStats:
    """Wait until the backend reports nothing running and no blocks used; returns the stats."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = engine.stats()
        idle = stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0 and stats.sessions == 0
        if (idle and len(engine.sessions) == 0) or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.01)


def assert_idle(engine: AsyncEngine, stats: BackendStats) -> None:
    assert len(engine.sessions) == 0, f"sessions left: {engine.sessions.ids()}"
    assert stats.running == 0 and stats.waiting == 0, stats
    assert stats.kv_blocks_used == 0, f"KV blocks leaked: {stats}"
    assert stats.sessions == 0, f"backend sessions leaked: {stats}"


@pytest.mark.asyncio
class BackendContractTests:
    """Subclass and provide an async `backend` fixture yielding a fresh Backend."""

    @pytest.fixture
    def prompt_token_ids(self, backend: Backend) -> list[int]:
        vocab = backend.model_info.vocab_size or 100
        return [(7 * i + 3) % vocab for i in range(1, 13)]

    @pytest.fixture
    async def spy(self, backend: Backend) -> SpyBackend:
        return SpyBackend(backend)

    @pytest.fixture
    async def engine(self, spy: SpyBackend) -> AsyncIterator[AsyncEngine]:
        engine = AsyncEngine(spy)
        yield engine
        await engine.close()

    async def _run(self, engine: AsyncEngine, prompt: Sequence[int], config: GenerationConfig = GREEDY) -> Response:
        return await collect(engine.generate(list(prompt), config))

    # -- stateless generate -------------------------------------------------------------------------

    async def test_greedy_is_repeatable_and_batch_independent(self, engine, prompt_token_ids):
        alone = await self._run(engine, prompt_token_ids)
        other = list(reversed(prompt_token_ids))
        together = await asyncio.gather(self._run(engine, prompt_token_ids), self._run(engine, other))
        assert alone.finish_reason == "length" and len(alone.token_ids) == GREEDY.max_new_tokens
        assert together[0].token_ids == alone.token_ids
        assert together[1].token_ids == (await self._run(engine, other)).token_ids

    async def test_every_request_carries_its_whole_context(self, engine, spy, prompt_token_ids):
        full = await self._run(engine, prompt_token_ids)
        again = await self._run(engine, prompt_token_ids[-3:])
        assert full.prompt_tokens == len(prompt_token_ids) and again.prompt_tokens == 3
        assert [list(r.prompt_token_ids) for r in spy.requests] == [prompt_token_ids, prompt_token_ids[-3:]]
        assert all(r.max_new_tokens == GREEDY.max_new_tokens for r in spy.requests)

    @pytest.mark.parametrize("keyword", REMOVED_KEYWORDS)
    async def test_removed_keywords_are_rejected(self, engine, prompt_token_ids, keyword):
        with pytest.raises(TypeError, match=keyword):
            engine.generate(prompt_token_ids, GREEDY, **{keyword: True})
        assert not any(hasattr(engine.backend, k) for k in REMOVED_KEYWORDS)
        assert len(engine.sessions) == 0

    async def test_max_new_tokens_and_n(self, engine, prompt_token_ids):
        config = GenerationConfig(temperature=0.0, max_new_tokens=3, ignore_eos=True, n=2)
        response = await self._run(engine, prompt_token_ids, config)
        assert [len(c.token_ids) for c in response.choices] == [3, 3]
        assert [c.finish_reason for c in response.choices] == ["length", "length"]

    async def test_prompt_logprobs_come_once_with_the_first_output_or_are_refused(self, engine, prompt_token_ids):
        config = GREEDY.replace(max_new_tokens=3, n=2, prompt_logprobs=1)
        if not engine.backend.supports_prompt_logprobs:
            with pytest.raises(UnsupportedError, match="prompt logprobs"):
                engine.generate(prompt_token_ids, config)
            return
        outputs = [output async for output in engine.generate(prompt_token_ids, config)]
        carrying = [output for output in outputs if output.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is outputs[0]
        entries = carrying[0].prompt_logprobs
        assert len(entries) == len(prompt_token_ids) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == list(prompt_token_ids[1:])
        assert all(len(e.top) == 1 and e.logprob <= 0 and e.rank >= 1 for e in entries[1:])

    # -- sessions -----------------------------------------------------------------------------------

    async def test_end_exactly_once_after_finish(self, engine, spy, prompt_token_ids):
        response = await self._run(engine, prompt_token_ids)
        assert spy.calls["generate", response.session_id] == 1
        assert spy.calls["end", response.session_id] == 1
        assert spy.calls["abort", response.session_id] == 0
        assert await spy.inner.end(response.session_id) is EndResult.NOT_FOUND
        assert_idle(engine, await wait_idle(engine))

    async def test_abort_mid_stream_frees_everything(self, engine, spy, prompt_token_ids):
        config = GREEDY.replace(max_new_tokens=engine.model_info.max_model_len - len(prompt_token_ids))
        stream = engine.generate(prompt_token_ids, config)
        outputs = []
        async for output in stream:
            outputs.append(output)
            if len(outputs) == 1:
                assert await engine.abort(stream.session_id)
        assert outputs[-1].finish_reason == "abort"
        assert spy.calls["abort", stream.session_id] == 1 and spy.calls["end", stream.session_id] == 1
        assert_idle(engine, await wait_idle(engine))

    async def test_abort_all_is_one_backend_call_and_ends_every_stream(self, engine, spy, prompt_token_ids):
        config = GREEDY.replace(max_new_tokens=engine.model_info.max_model_len - len(prompt_token_ids))
        streams = [engine.generate(prompt_token_ids[i:], config) for i in range(6)]
        firsts = [await stream.__anext__() for stream in streams]
        assert await engine.abort_all() == len(streams)
        outputs = await asyncio.gather(*(collect(stream) for stream in streams))
        assert all(first.finish_reason is None for first in firsts)
        assert [o.finish_reason for o in outputs] == ["abort"] * len(streams)
        assert spy.calls["abort_many", ""] == 1
        assert all(spy.calls["abort", s.session_id] == 1 for s in streams)
        assert_idle(engine, await wait_idle(engine))

    async def test_closing_the_stream_early_ends_the_session(self, engine, spy, prompt_token_ids):
        stream = engine.generate(prompt_token_ids, GREEDY.replace(max_new_tokens=50))
        async for _ in stream:
            break
        await stream.aclose()
        assert spy.calls["abort", stream.session_id] == 1 and spy.calls["end", stream.session_id] == 1
        assert_idle(engine, await wait_idle(engine))

    async def test_cancelled_task_ends_the_session(self, engine, spy, prompt_token_ids):
        stream = engine.generate(prompt_token_ids, GREEDY.replace(max_new_tokens=200))
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                first.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await wait_idle(engine)
        assert spy.calls["end", stream.session_id] == 1
        assert_idle(engine, stats)

    async def test_user_session_id_conflict(self, engine, prompt_token_ids):
        stream = engine.generate(prompt_token_ids, GREEDY, session_id="user-1")
        with pytest.raises(SessionConflictError) as info:
            engine.generate(prompt_token_ids, GREEDY, session_id="user-1")
        assert info.value.code is ErrorCode.CONFLICT and info.value.http_status == 409
        await collect(stream)
        await collect(engine.generate(prompt_token_ids, GREEDY, session_id="user-1"))  # reusable when done
        assert len(engine.sessions) == 0

    async def test_stop_all_drops_work_stamped_earlier(self, engine, spy, prompt_token_ids):
        stream = engine.generate(prompt_token_ids, GREEDY)
        await engine.stop_all()
        response = await collect(stream)
        assert response.finish_reason == "abort" and response.token_ids == []
        assert spy.calls["generate", stream.session_id] == 0
        assert spy.calls["end", stream.session_id] == 0
        assert (await self._run(engine, prompt_token_ids)).finish_reason == "length"

    # -- sleep --------------------------------------------------------------------------------------

    async def test_sleep_gate_and_tags(self, engine, prompt_token_ids):
        before = await self._run(engine, prompt_token_ids)
        await engine.sleep(1)
        assert engine.is_sleeping and engine.backend.is_sleeping
        with pytest.raises(EngineSleepingError) as info:
            engine.generate(prompt_token_ids, GREEDY)
        assert info.value.http_status == 503
        await engine.wakeup(["weights"])
        with pytest.raises(EngineSleepingError):
            engine.generate(prompt_token_ids, GREEDY)
        await engine.wakeup(["kv_cache"])
        assert not engine.is_sleeping and not engine.backend.is_sleeping
        assert (await self._run(engine, prompt_token_ids)).token_ids == before.token_ids
        assert_idle(engine, await wait_idle(engine))

    @pytest.mark.parametrize("level", [2, 1])
    async def test_sleep_aborts_in_flight_requests(self, engine, prompt_token_ids, level):
        stream = engine.generate(prompt_token_ids, GREEDY.replace(max_new_tokens=200))
        outputs = [await stream.__anext__()]
        await engine.sleep(level)
        outputs += [o async for o in stream]
        assert outputs[-1].finish_reason == "abort"
        await engine.wakeup()
        assert (await self._run(engine, prompt_token_ids)).finish_reason == "length"
        assert_idle(engine, await wait_idle(engine))

    async def test_sleep_and_wakeup_arguments(self, engine):
        with pytest.raises(ValueError, match="level"):
            await engine.sleep(3)
        with pytest.raises(ValueError, match="unknown wakeup tag 'brain'"):
            await engine.wakeup(["brain"])

    # -- errors -------------------------------------------------------------------------------------

    async def test_errors_map_to_codes(self, engine, prompt_token_ids):
        too_long = prompt_token_ids * (engine.model_info.max_model_len // len(prompt_token_ids) + 1)
        with pytest.raises(ContextTooLongError) as info:
            engine.generate(too_long, GREEDY)
        assert info.value.code is ErrorCode.CONTEXT_TOO_LONG and info.value.http_status == 400
        with pytest.raises(InvalidRequestError) as info:
            engine.generate(prompt_token_ids, max_new_tokens=0)
        assert info.value.param == "max_new_tokens" and info.value.http_status == 400
        with pytest.raises(InvalidRequestError, match="prompt"):
            engine.generate([], GREEDY)
        assert len(engine.sessions) == 0

    async def test_many_concurrent_requests_with_cancellations_leak_nothing(self, engine, prompt_token_ids):
        streams = [engine.generate(prompt_token_ids[i % 5:], GREEDY.replace(max_new_tokens=6)) for i in range(12)]

        async def consume(i: int) -> None:
            async for _ in streams[i]:
                if i % 3 == 0:
                    break
            await streams[i].aclose()

        await asyncio.gather(*(consume(i) for i in range(len(streams))))
        assert_idle(engine, await wait_idle(engine))
