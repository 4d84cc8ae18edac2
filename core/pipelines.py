"""Pipeline: synchronous offline inference, streaming and multi-turn chat over AsyncEngine.

The engine runs on a private event-loop thread; every public method is a plain blocking call. Chat is
stateless at the engine: each turn sends the whole history, rebuilt from the ChatSession, and a turn is
recorded only when it finished normally.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.adapters import AdapterPolicy
from core.channel import ThreadChannel
from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import CoreError, EngineUnavailableError
from core.media import image_prompt_messages
from core.request import RequestOutput, reject_removed_keywords
from core.response import Response
from core.stream import merge

ADAPTER_OPTIONS = ("lora_modules", "max_loras", "max_lora_rank")  # pipeline() keywords of AdapterPolicy

T = TypeVar("T")
FAILED_FINISH_REASONS = ("abort", "error")
DROPPED_MESSAGE = ("the engine was stopped (stop_all, sleep or an abort) before this request started; "
                   "nothing was generated: send it again once the engine is awake")


class _LoopThread:
    """An asyncio loop on a daemon thread, with blocking helpers to run work on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="core-pipeline-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt in the caller: stop the work on the loop too
            raise

    def iterate(self, agen_factory: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
        """Drive an async iterator on the loop, yielding its items here; closing stops it there."""
        channel = ThreadChannel()

        async def pump() -> None:
            try:
                async for item in agen_factory():
                    channel.send(item)
            except BaseException as exc:  # handed to the consuming thread
                channel.send(exc)
            finally:
                channel.close()

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        finished = False
        try:
            yield from channel
            finished = True
        finally:
            if not finished:
                # Stopped early: cancel the work on the loop and wait until its cleanup has run
                # (the concurrent future reports "cancelled" before that, so wait for the close).
                future.cancel()
                channel.wait_closed(timeout=60)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@dataclass
class ChatSession:
    """A multi-turn conversation: its message history and the last response."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    response: Response | None = None

    @property
    def history(self) -> list[tuple[str, str]]:
        """(user, assistant) pairs of the recorded turns."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        bots = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return list(zip(users, bots, strict=False))


class Pipeline:
    """Blocking offline inference over an AsyncEngine running on its own thread."""

    def __init__(self, engine: AsyncEngine | Callable[[], AsyncEngine]) -> None:
        self._loop = _LoopThread()
        try:
            self.engine = engine if isinstance(engine, AsyncEngine) else self._loop.run(_build(engine))
        except BaseException:
            self._loop.stop()
            raise

    @classmethod
    def from_config(cls, config: EngineConfig) -> Pipeline:
        return cls(lambda: AsyncEngine.from_config(config))

    # -- batch ----------------------------------------------------------------------------------------

    def infer(self, prompts: Any, gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
              *, use_tqdm: bool | None = None, **kwargs: Any) -> Response | list[Response]:
        """Generate for one prompt (returns a Response) or a list of prompts (a list, in order).

        A prompt is a string, a list of token ids, a list of chat messages (whose content may hold
        image parts), or a ``(text, image_or_images)`` pair for a vision model. `gen_config` is one
        GenerationConfig for all prompts or one per prompt; generation fields may be keywords.

        In a batch each item ends on its own: one that fails (too long, invalid, a backend error, or
        stopped by `stop_all`/sleep before it started) comes back with finish_reason "error" and its
        message in `Response.error`, the others normally. A single prompt raises its error instead.
        An unexpected exception (a bug, not a `CoreError`) is raised after the other items are
        cancelled and cleaned up.
        """
        reject_removed_keywords("infer", kwargs)
        batch, single = _as_batch(prompts)
        configs = _configs_for(batch, gen_config, kwargs)
        show = len(batch) > 1 if use_tqdm is None else use_tqdm
        responses = self._loop.run(self._infer_all(batch, configs, show, raise_errors=single))
        return responses[0] if single else responses

    async def _infer_all(self, batch: list[Any], configs: list[GenerationConfig], show: bool,
                         raise_errors: bool) -> list[Response]:
        progress = _progress(len(batch), show)
        tasks = [asyncio.ensure_future(self._infer_one(i, prompt, config, raise_errors))
                 for i, (prompt, config) in enumerate(zip(batch, configs, strict=True))]
        for task in tasks:
            task.add_done_callback(lambda _: progress.update(1))
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # after a failure or a cancellation: the other items are stopped and cleaned up here
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.close()

    async def _infer_one(self, index: int, prompt: Any, config: GenerationConfig, raise_errors: bool) -> Response:
        """One batch item, start to end; a CoreError ends it as a failed Response (see infer)."""
        response = Response(index=index)
        try:
            stream = self.engine.generate(_engine_inputs(prompt), config)
            try:
                async for output in stream:
                    response.add(output)
            finally:
                await stream.aclose()
            if response.finish_reason == "abort" and not stream.reached_backend:
                response = Response(index=index)  # its "abort" choices hold nothing: they become errors
                raise EngineUnavailableError(DROPPED_MESSAGE)
        except CoreError as exc:
            if raise_errors:
                raise
            response.fail(str(exc), config.n)
        return response

    def stream_infer(self, prompts: Any, gen_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                     **kwargs: Any) -> Iterator[tuple[int, RequestOutput]]:
        """Stream outputs of every prompt as they come, each with its prompt's index."""
        reject_removed_keywords("stream_infer", kwargs)
        batch, _ = _as_batch(prompts)
        configs = _configs_for(batch, gen_config, kwargs)
        return self._loop.iterate(lambda: self._multiplex(batch, configs))

    async def _multiplex(self, batch: list[Any], configs: list[GenerationConfig]) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [self.engine.generate(_engine_inputs(p), c) for p, c in zip(batch, configs, strict=True)]
        merged = merge(streams)
        try:
            async for item in merged:
                yield item
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
            for stream in streams:
                await stream.aclose()

    # -- chat -----------------------------------------------------------------------------------------

    def chat(self, prompt: str | Mapping[str, Any] | tuple[str, Any], session: ChatSession | None = None,
             gen_config: GenerationConfig | None = None, **kwargs: Any) -> ChatSession:
        """One chat turn. The whole history is sent; the turn is recorded only if it succeeded.

        `prompt` is the user's text, a whole user message (its content may hold image parts), or a
        ``(text, image_or_images)`` pair; earlier turns keep their images.
        """
        session = session if session is not None else ChatSession()
        for _ in self.stream_chat(prompt, session, gen_config, **kwargs):
            pass
        return session

    def stream_chat(self, prompt: str | Mapping[str, Any] | tuple[str, Any], session: ChatSession,
                    gen_config: GenerationConfig | None = None, **kwargs: Any) -> Iterator[str]:
        """One chat turn, yielding text deltas; the turn is recorded only if it finished normally."""
        reject_removed_keywords("chat", kwargs)
        if _is_image_prompt(prompt):
            [user] = _engine_inputs(prompt)
        else:
            user = {"role": "user", "content": prompt} if isinstance(prompt, str) else dict(prompt)
        messages = [*session.messages, user]
        config = _configs_for([messages], gen_config, kwargs)[0]
        response = Response()
        session.response = response
        for output in self._loop.iterate(lambda: self.engine.generate(messages, config)):
            response.add(output)
            yield output.text
        if response.finish_reason not in FAILED_FINISH_REASONS:
            session.messages = [*messages, {"role": "assistant", "content": response.text}]

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine and its thread. Idempotent."""
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self.engine.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _build(factory: Callable[[], AsyncEngine]) -> AsyncEngine:
    return factory()


def _is_image_prompt(prompt: Any) -> bool:
    """A ``(text, image_or_images)`` pair. Batches are lists, so a tuple of two is never a batch."""
    return isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[0], str)


def _engine_inputs(prompt: Any) -> Any:
    """What the engine takes for one prompt: a ``(text, images)`` pair becomes one user message whose
    images come first; local paths are read here (the caller's own files, not a server's)."""
    if not _is_image_prompt(prompt):
        return prompt
    text, images = prompt
    pictures = list(images) if isinstance(images, (list, tuple)) else [images]
    return image_prompt_messages(text, [_open_local(p) for p in pictures])


def _open_local(image: Any) -> Any:
    if not isinstance(image, str) or "://" in image or image.startswith("data:"):
        return image
    from PIL import Image

    path = image[len("file:"):] if image.startswith("file:") else image
    with Image.open(path) as opened:
        opened.load()
        return opened.copy()


def _is_single(prompt: Any) -> bool:
    if isinstance(prompt, str) or _is_image_prompt(prompt):
        return True
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(x, (int, Mapping)) for x in prompt)


def _as_batch(prompts: Any) -> tuple[list[Any], bool]:
    if _is_single(prompts):
        return [prompts], True
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts), False
    raise ValueError("prompts must be a prompt (string, token ids, messages) or a non-empty list of prompts")


def _configs_for(batch: list[Any], gen_config: Any, overrides: Mapping[str, Any]) -> list[GenerationConfig]:
    if gen_config is None or isinstance(gen_config, GenerationConfig):
        configs = [gen_config or GenerationConfig()] * len(batch)
    else:
        configs = list(gen_config)
        if len(configs) != len(batch):
            raise ValueError(f"gen_config has {len(configs)} entries for {len(batch)} prompts")
    return [c.replace(**overrides) if overrides else c for c in configs]


def _progress(total: int, show: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="req", disable=not show)


def pipeline(model: str | None = None, *, backend: str | None = None, **engine_options: Any) -> Pipeline:
    """A Pipeline serving `model` (a HF folder or GGUF file; None = the default model).

    LoRA adapters: ``lora_modules={"name": path}`` (or ``["name=path"]``), ``max_loras``, ``max_lora_rank``
    (core.adapters.AdapterPolicy); a request picks one with ``adapter="name"``.
    """
    policy = {key: engine_options.pop(key) for key in ADAPTER_OPTIONS if key in engine_options}
    if policy:
        engine_options["adapters"] = AdapterPolicy(**policy)
    return Pipeline.from_config(EngineConfig(model=model, backend=backend, **engine_options))
