"""AsyncEngine: stateless generate over a backend, with sessions, detokenization and the sleep gate.

Data flows: inputs -> RequestPreparer (template, tokens, limits) -> Session -> backend.generate ->
per-choice IncrementalDetokenizer -> RequestOutput. Every path out of a request (finish, error,
cancellation, the caller closing the stream early) aborts the backend work at most once, ends the backend
session exactly once and removes the Session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from core.backend import (
    WAKE_TAGS,
    Backend,
    BackendOutput,
    BackendStats,
    FinishReason,
    GenerateRequest,
    ModelInfo,
)
from core.chat_template import ChatTemplate, resolve_chat_template
from core.config import EngineConfig, GenerationConfig
from core.detokenize import IncrementalDetokenizer
from core.errors import (
    BackendError,
    CoreError,
    EngineSleepingError,
    EngineUnavailableError,
    InvalidRequestError,
    UnsupportedError,
)
from core.memory import trim_heap
from core.multimodal import (
    MediaPolicy,
    VisionProcessor,
    extract_images,
    find_vision_processor,
    is_decoded_image,
    load_images,
    with_loaded_images,
)
from core.openmp import release_openmp_pool
from core.request import (
    Inputs,
    PreparedRequest,
    RequestOutput,
    RequestPreparer,
    is_message_list,
    merge_config,
    reject_removed_keywords,
)
from core.session import Session, SessionManager, SessionState

log = logging.getLogger(__name__)
MEDIA_THREADS = 4  # concurrent image fetches and decodes
PREPARE_THREADS = 2  # requests rendered and tokenized at once, off the event loop
DRAIN_POLL_SECONDS = 0.05


class AsyncEngine:
    """The asynchronous engine: every request carries its full context; nothing is kept between them."""

    def __init__(self, backend: Backend, *, chat_template: ChatTemplate | None = None,
                 model_name: str | None = None, vision: VisionProcessor | None = None,
                 media_policy: MediaPolicy | None = None, allow_special_tokens_in_content: bool = False,
                 model_aliases: Sequence[str] = (), chat_template_content_format: str = "auto") -> None:
        self.backend = backend
        self.model_name = model_name or backend.model_info.name
        #: Every name clients may use: the reported name first, then the aliases.
        self.model_names = tuple(dict.fromkeys((self.model_name, *model_aliases)))
        self.preparer = RequestPreparer(backend.model_info, backend.tokenizer, chat_template, vision, media_policy,
                                        allow_special_tokens_in_content=allow_special_tokens_in_content,
                                        content_format=chat_template_content_format)
        if chat_template is not None:
            log.info("chat template content format: %s", self.preparer.content_format)
        self.sessions = SessionManager(backend)
        self.vision = vision
        # One thread runs the vision encoder, off the event loop, once per request with images; a few
        # more fetch and decode images (load_media).
        self._vision_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._media_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._prepare_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._asleep: set[str] = set()
        self._transition = asyncio.Lock()  # one sleep or wakeup at a time
        self._draining = False
        self._closed = False

    @classmethod
    def from_config(cls, config: EngineConfig, plugins: Any = None) -> AsyncEngine:
        """Build the backend that `config` names (or the best available one) and its chat template."""
        from core.backend_selection import select_backend
        from core.plugins import get_plugins

        plugins = plugins or get_plugins()
        backend = select_backend(plugins, config.backend).load()(config)
        template = resolve_chat_template(plugins, config.chat_template, backend.model_info, backend.tokenizer)
        vision = find_vision_processor(plugins, backend.model_info.architecture, config.model)
        release_openmp_pool()  # loading is done on this thread; see core.openmp
        return cls(backend, chat_template=template, model_name=config.served_model_name, vision=vision,
                   media_policy=config.media, allow_special_tokens_in_content=config.allow_special_tokens_in_content,
                   model_aliases=config.served_model_aliases,
                   chat_template_content_format=config.chat_template_content_format)

    # -- properties ---------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.backend.model_info

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def is_sleeping(self) -> bool:
        """True while the gate is closed (a sleep started, a part is not awake again) or the backend
        itself reports a part asleep: the state the server reports is never more awake than the backend."""
        return bool(self._asleep) or self.backend.is_sleeping

    @property
    def is_closed(self) -> bool:
        """True once `close` ran: the engine serves nothing any more."""
        return self._closed

    @property
    def asleep_tags(self) -> frozenset[str]:
        return frozenset(self._asleep)

    def stats(self) -> BackendStats:
        return self.backend.stats()

    # -- generate -----------------------------------------------------------------------------------

    def generate(
        self,
        inputs: Inputs,
        config: GenerationConfig | None = None,
        *,
        session_id: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Start one request and return its stream of RequestOutputs.

        `inputs` is a prompt string, a list of token ids, or OpenAI-style messages. Generation fields
        may also be given as keywords (max_new_tokens=8). Validation happens here, eagerly: bad input
        raises InvalidRequestError (a ValueError naming the field) before anything is queued. The
        removed keywords sequence_start, sequence_end, step and interactive raise a TypeError.
        """
        reject_removed_keywords("generate", kwargs)
        self._check_gate()
        prepared = self.preparer.prepare(
            inputs, self._supported(merge_config(config, kwargs)), add_generation_prompt=add_generation_prompt,
            tools=tools, chat_template_kwargs=chat_template_kwargs,
        )
        return RequestStream(self, self.sessions.create(session_id), prepared)

    async def generate_async(
        self,
        inputs: Inputs,
        config: GenerationConfig | None = None,
        *,
        session_id: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """`generate`, with the slow part off the event loop: images fetched on the media threads, the
        prompt rendered and tokenized on a preparation thread (what the server uses: a 20 MB message
        delays only its own request).

        The session exists from the call on (stamped with the epoch), so an abort by id or `stop_all`
        during preparation ends the request with "abort"; a request that fails preparation leaves none.
        """
        reject_removed_keywords("generate", kwargs)
        self._check_gate()
        config = self._supported(merge_config(config, kwargs))
        session = self.sessions.create(session_id)
        try:
            inputs = await self.load_media(inputs)
            prepared = await self._off_loop(self.preparer.prepare, inputs, config,
                                            add_generation_prompt=add_generation_prompt, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs)
        except BaseException:
            self.sessions.remove(session)
            # A failed preparation is usually an input too large for the context: its render and tokens
            # (hundreds of MB for a multi-MB message) are freed but kept by the allocator. Trim on the
            # preparation thread, without waiting.
            self._prepare_pool().submit(trim_heap)
            raise
        return RequestStream(self, session, prepared)

    async def tokenize_async(self, inputs: Inputs, *, add_special_tokens: bool = True,
                             **render_options: Any) -> list[int]:
        """`tokenize` off the event loop (images loaded on the media threads); `add_special_tokens`
        False tokenizes a prompt string without the tokenizer's bos."""
        inputs = await self.load_media(inputs)
        if isinstance(inputs, str) and not add_special_tokens:
            return list(await self._off_loop(self.tokenizer.encode, inputs, add_special_tokens=False))
        return await self._off_loop(self.tokenize, inputs, **render_options)

    def _prepare_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._prepare_executor is None:
            self._prepare_executor = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS,
                                                                           thread_name_prefix="core-prepare")
        return self._prepare_executor

    async def _off_loop(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool(), call)

    async def load_media(self, inputs: Inputs) -> Inputs:
        """``inputs`` with their images fetched and decoded on the media threads, off the event loop.

        The server awaits this before `generate`, which then finds the images already decoded: a slow
        image URL (up to the media fetch timeout) delays only its own request. Inputs without images,
        and engines without a vision processor (whose `generate` refuses images), pass through as they
        are; a bad image raises the same InvalidRequestError that `generate` would.
        """
        if self.vision is None or not is_message_list(inputs):
            return inputs
        _, sources = extract_images(inputs)
        if all(is_decoded_image(s.source) for s in sources):
            return inputs
        if self._media_executor is None:
            self._media_executor = concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="core-media")
        loop = asyncio.get_running_loop()
        images = await loop.run_in_executor(self._media_executor, load_images, sources, self.preparer.media_policy)
        return with_loaded_images(inputs, images)

    def _supported(self, config: GenerationConfig) -> GenerationConfig:
        """`config`, or an UnsupportedError for what the backend cannot do."""
        if config.prompt_logprobs is not None and not self.backend.supports_prompt_logprobs:
            raise UnsupportedError(f"the {type(self.backend).__name__} backend does not return prompt logprobs",
                                   param="prompt_logprobs")
        return config

    def _check_gate(self) -> None:
        if self._closed or self._draining:
            raise EngineUnavailableError("the engine is shut down" if self._closed else "the server is shutting down")
        if self.is_sleeping:
            raise EngineSleepingError(self._asleep)

    async def _run(self, session: Session, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        choices = _Choices(self, session, prepared)
        backend_stream: AsyncIterator[BackendOutput] | None = None
        try:
            request = self._backend_request(session, prepared)
            if prepared.multimodal is not None:
                request = await self._with_image_embeddings(request)
            if self.sessions.is_stale(session) or session.state is SessionState.ABORTED:
                for output in choices.abort_all():  # never reaches the backend
                    yield output
                return
            self._check_gate()
            session.reached_backend, session.state = True, SessionState.RUNNING
            backend_stream = self.backend.generate(request)
            async for backend_output in backend_stream:
                output = choices.update(backend_output)
                if output is not None:
                    yield output
                if choices.all_finished:
                    break
            for output in choices.finish_unfinished():
                yield output
        except CoreError:
            raise
        except Exception as exc:
            log.exception("backend failed while serving %s", session.id)
            raise BackendError(f"internal error while generating ({type(exc).__name__}); see the server log") from exc
        finally:
            release = self._release(session, backend_stream, needs_abort=not choices.backend_finished)
            await asyncio.shield(release)

    def _backend_request(self, session: Session, prepared: PreparedRequest) -> GenerateRequest:
        return GenerateRequest(
            session_id=session.id, prompt_token_ids=prepared.prompt_token_ids, config=prepared.config,
            max_new_tokens=prepared.max_new_tokens, stop_token_ids=prepared.stop_token_ids,
            multimodal=prepared.multimodal,
        )

    async def _with_image_embeddings(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with its images encoded by the vision processor (on the vision thread)."""
        inputs = request.multimodal
        if self.vision is None or inputs is None:
            raise BackendError("a request with images reached an engine without a vision processor")
        if self._vision_executor is None:
            self._vision_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-vision")
        loop = asyncio.get_running_loop()
        embeds = await loop.run_in_executor(self._vision_executor, self._encode_images, inputs)
        return dataclasses.replace(request, multimodal=dataclasses.replace(inputs, image_embeds=embeds))

    def _encode_images(self, inputs: Any) -> Any:
        """On the vision thread: encode, then free its OpenMP workers so the engine thread's keep
        spinning (core.openmp)."""
        try:
            return self.vision.encode(inputs)
        finally:
            release_openmp_pool()

    async def _release(self, session: Session, backend_stream: AsyncIterator[BackendOutput] | None, *,
                       needs_abort: bool) -> None:
        """Abort unfinished work (at most once), close the backend's stream, end the session once."""
        try:
            if needs_abort:
                await self.sessions.abort(session)
            aclose = getattr(backend_stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self.sessions.close(session)

    # -- control ------------------------------------------------------------------------------------

    async def abort(self, session_id: str) -> bool:
        """Abort one request by id; False if no such request is in flight."""
        return await self.sessions.abort_id(session_id)

    async def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return await self.sessions.abort_all()

    async def stop_all(self) -> int:
        """Start a new epoch: abort everything in flight, and anything stamped earlier not yet started."""
        return await self.sessions.stop_all()

    async def sleep(self, level: int = 1) -> None:
        """Close the gate, abort in-flight requests, then free memory (level 1 or 2).

        Sleep and wakeup are serialised: one called while the other (or another sleep) runs waits for
        it to finish. Sleeping while asleep does nothing, and returns only once the memory is released.
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
        async with self._transition:
            if self._closed:
                raise EngineUnavailableError("the engine is shut down")
            if self.is_sleeping:
                return
            self._asleep = set(WAKE_TAGS)
            await self.sessions.stop_all()
            await self.backend.sleep(level)

    async def wakeup(self, tags: Iterable[str] | None = None) -> None:
        """Restore the parts named by tags (default: all); serving resumes when every part is awake.

        Waits for a sleep (or wakeup) in progress to finish first.
        """
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = sorted(wanted - WAKE_TAGS)
        if unknown or not wanted:
            raise InvalidRequestError(
                f"unknown wakeup tag {unknown[0]!r}; use weights and/or kv_cache" if unknown
                else "tags must name weights and/or kv_cache",
                param="tags",
            )
        async with self._transition:
            # A backend that reports itself asleep is woken even if the gate thinks it is awake.
            to_wake = sorted(wanted & self._asleep or (wanted if self.backend.is_sleeping else set()))
            if to_wake:
                await self.backend.wakeup(to_wake)
                self._asleep -= set(to_wake)

    def tokenize(self, inputs: Inputs, **render_options: Any) -> list[int]:
        """Token ids for a prompt string or chat messages, exactly as generate would see them."""
        return list(self.preparer.tokenize(inputs, **render_options)[0])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text for token ids."""
        return self.tokenizer.decode(list(token_ids))

    async def drain(self, timeout: float) -> int:
        """Stop accepting requests (EngineUnavailableError), let those in flight finish for up to
        `timeout` seconds, then abort the rest; returns how many were aborted. For a graceful shutdown."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.sessions) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        return await self.abort_all() if len(self.sessions) else 0

    async def close(self) -> None:
        """Abort everything and close the backend. Idempotent; the backend is closed even if the abort
        fails (a backend whose engine died)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.sessions.stop_all()
        except Exception:
            log.exception("aborting the requests in flight failed while closing")
        await self.backend.close()
        for executor in (self._vision_executor, self._media_executor, self._prepare_executor):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


class RequestStream:
    """The async iterator of one request's outputs, with its session id.

    A stream that is never iterated holds no backend resources: closing it (or dropping it) just
    forgets its session.
    """

    def __init__(self, engine: AsyncEngine, session: Session, prepared: PreparedRequest) -> None:
        self.session = session
        self.prepared = prepared
        self._engine = engine
        self._generator = engine._run(session, prepared)
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
            self._engine.sessions.remove(self.session)
            self._started = True
        await self._generator.aclose()

    def __del__(self) -> None:
        if not getattr(self, "_started", True):
            self._engine.sessions.remove(self.session)


class _Choices:
    """Per-choice detokenization and finish tracking for one request (n choices)."""

    def __init__(self, engine: AsyncEngine, session: Session, prepared: PreparedRequest) -> None:
        cfg = prepared.config
        self._session_id = session.id
        self._prompt_tokens = len(prepared.prompt_token_ids)
        self._config = cfg
        self._detokenizers = [
            IncrementalDetokenizer(
                engine.tokenizer, prepared.prompt_token_ids, skip_special_tokens=cfg.skip_special_tokens,
                stop=prepared.stop_strings, include_stop_str_in_output=cfg.include_stop_str_in_output,
            )
            for _ in range(cfg.n)
        ]
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
        self._counts[i] += len(out.token_ids)
        self._cached = max(self._cached, out.num_cached_tokens)
        return self._output(i, out)

    def _output(self, i: int, out: BackendOutput) -> RequestOutput:
        ids = list(out.token_ids)
        stopped_on_token = out.finish_reason is FinishReason.STOP and out.stop_token_id is not None
        text_ids = ids[:-1] if stopped_on_token and not self._config.include_stop_str_in_output else ids
        delta = self._detokenizers[i].update(text_ids, final=out.finish_reason is not None)
        finish, stop_reason = (out.finish_reason.value if out.finish_reason else None), out.stop_token_id
        if delta.stop is not None:
            finish, stop_reason = FinishReason.STOP.value, delta.stop
        self._finished[i] = finish
        return RequestOutput(
            session_id=self._session_id, index=i, text=delta.text, token_ids=ids,
            prompt_tokens=self._prompt_tokens, completion_tokens=self._counts[i], cached_tokens=self._cached,
            finish_reason=finish, stop_reason=stop_reason if finish else None,
            logprobs=list(out.logprobs) if out.logprobs is not None else None,
            prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
        )

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
