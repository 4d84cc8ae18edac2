"""One request's stream of outputs, how backend outputs become them, and several streams merged.

`RequestStream` is what `AsyncEngine.generate` returns: it owns the generator that runs the request and a
callback that forgets the session of a stream closed (or dropped) before it started. `Choices` turns the
backend's token ids into per-choice text (incremental detokenization, stop strings) and finish reasons.
`merge` interleaves several streams as their items come (a batch in `Pipeline`, a list prompt in the
server).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from core.backend import BackendOutput, FinishReason, Tokenizer
from core.detokenize import IncrementalDetokenizer, TextDelta
from core.errors import BackendError
from core.request import PreparedRequest, RequestOutput
from core.session import Session

T = TypeVar("T")


class RequestStream:
    """The async iterator of one request's outputs, with its session id.

    A stream that is never iterated holds no backend resources: closing it (or dropping it) just
    forgets its session.
    """

    def __init__(self, session: Session, prepared: PreparedRequest, generator: AsyncIterator[RequestOutput],
                 forget: Callable[[], object]) -> None:
        self.session = session
        self.prepared = prepared
        self._generator = generator  # runs the request (AsyncEngine._run); closing it cleans up
        self._forget = forget  # drops the session of a stream that never started
        self._started = False

    @property
    def session_id(self) -> str:
        return self.session.id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.prepared.prompt_token_ids

    @property
    def reached_backend(self) -> bool:
        """False for a request that ended before the backend saw it (stop_all, sleep or an abort ran
        first: it finished "abort" with nothing generated)."""
        return self.session.reached_backend

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self._started = True
        return await self._generator.__anext__()

    async def aclose(self) -> None:
        """Stop early; the backend work is aborted and its session ended."""
        if not self._started:
            self._forget()
            self._started = True
        await self._generator.aclose()  # type: ignore[attr-defined]

    def __del__(self) -> None:
        if not getattr(self, "_started", True):
            self._forget()


class Choices:
    """Per-choice detokenization and finish tracking for one request (n choices)."""

    def __init__(self, tokenizer: Tokenizer, session_id: str, prepared: PreparedRequest) -> None:
        cfg = prepared.config
        self._session_id = session_id
        self._prompt_tokens = len(prepared.prompt_token_ids)
        self._config = cfg
        self._detokenizers = [
            IncrementalDetokenizer(
                tokenizer, prepared.prompt_token_ids, skip_special_tokens=cfg.skip_special_tokens,
                stop=prepared.stop_strings, include_stop_str_in_output=cfg.include_stop_str_in_output,
            )
            for _ in range(cfg.n)
        ]
        self._stops = bool(prepared.stop_strings)
        self._counts = [0] * cfg.n
        self._finished: list[str | None] = [None] * cfg.n
        self._backend_done = [False] * cfg.n
        self._cached = 0

    @property
    def all_finished(self) -> bool:
        return all(self._finished)

    @property
    def backend_finished(self) -> bool:
        return all(self._backend_done)

    def update(self, out: BackendOutput) -> RequestOutput | None:
        i = out.index
        if not 0 <= i < len(self._finished):
            raise BackendError(f"backend returned choice index {i} for a request with n={len(self._finished)}")
        if out.finish_reason is not None:
            self._backend_done[i] = True
        if self._finished[i] is not None:
            return None  # this choice already stopped on a stop string; drop the backend's tail
        if out.finish_reason is FinishReason.ERROR:
            raise BackendError("the backend failed this request")
        self._cached = max(self._cached, out.num_cached_tokens)
        return self._output(i, out)

    def _output(self, i: int, out: BackendOutput) -> RequestOutput:
        ids = list(out.token_ids)
        stopped_on_token = out.finish_reason is FinishReason.STOP and out.stop_token_id is not None
        text_ids = ids[:-1] if stopped_on_token and not self._config.include_stop_str_in_output else ids
        delta, used = self._detokenize(i, text_ids, final=out.finish_reason is not None)
        finish, stop_reason = (out.finish_reason.value if out.finish_reason else None), out.stop_token_id
        if delta.stop is not None:
            finish, stop_reason = FinishReason.STOP.value, delta.stop
            ids = ids[:used]  # the tokens after the one that completed the stop string are not the text's
        self._finished[i] = finish
        self._counts[i] += len(ids)
        return RequestOutput(
            session_id=self._session_id, index=i, text=delta.text, token_ids=ids,
            prompt_tokens=self._prompt_tokens, completion_tokens=self._counts[i], cached_tokens=self._cached,
            finish_reason=finish, stop_reason=stop_reason if finish else None,
            logprobs=list(out.logprobs)[:len(ids)] if out.logprobs is not None else None,
            prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
        )

    def _detokenize(self, i: int, ids: list[int], final: bool) -> tuple[TextDelta, int]:
        """The text of `ids` and how many of them it used: all, unless a stop string ended it, at the token
        that completed the stop string (vLLM keeps a choice's tokens up to that one). An output of several
        tokens (a backend that accepts speculated tokens may send them at once) is read a token at a time."""
        detokenizer = self._detokenizers[i]
        if not self._stops or len(ids) < 2:
            return detokenizer.update(ids, final=final), len(ids)
        text = ""
        for used, token in enumerate(ids, start=1):
            delta = detokenizer.update([token], final=final and used == len(ids))
            text += delta.text
            if delta.stop is not None:
                return TextDelta(text, delta.stop), used
        return TextDelta(text), len(ids)

    def abort_all(self) -> list[RequestOutput]:
        self._backend_done = [True] * len(self._finished)
        return self.finish_unfinished()

    def finish_unfinished(self) -> list[RequestOutput]:
        """Close choices the backend left open (it stopped on abort): finish_reason "abort"."""
        outputs = []
        for i, finished in enumerate(self._finished):
            if finished is None:
                self._finished[i] = FinishReason.ABORT.value
                outputs.append(RequestOutput(
                    session_id=self._session_id, index=i, text=self._detokenizers[i].update((), final=True).text,
                    token_ids=[], prompt_tokens=self._prompt_tokens, completion_tokens=self._counts[i],
                    cached_tokens=self._cached, finish_reason=FinishReason.ABORT.value,
                ))
        return outputs


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
        except BaseException as exc:  # raised where the merged items are read
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
