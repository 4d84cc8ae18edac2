"""AsyncEngine: stateless generate over a backend, with sessions, detokenization and the sleep gate.

Data flows: inputs -> `prepare` (core.preparation: images, template, tokens, limits, on worker threads)
-> PreparedRequest -> `generate` -> Session -> backend.generate -> per-choice detokenization
(core.stream) -> RequestOutput. Every path out of a request (finish, error, cancellation, the caller
closing the stream early) aborts the backend work at most once, ends the backend session exactly once
and removes the Session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from core.adapters import AdapterInfo, AdapterPolicy, LoraModule, check_adapter_name
from core.backend import (
    WAKE_TAGS,
    Backend,
    BackendOutput,
    BackendStats,
    GenerateRequest,
    ModelInfo,
)
from core.chat_template import ChatTemplate
from core.config import EngineConfig, GenerationConfig
from core.errors import (
    BackendError,
    CoreError,
    EngineSleepingError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedError,
)
from core.media import MediaPolicy
from core.pooling import Embedding, check_embedding_inputs
from core.preparation import PreparationStage
from core.request import (
    Inputs,
    PreparedRequest,
    RequestOutput,
    RequestPreparer,
    merge_config,
    reject_removed_keywords,
)
from core.session import Session, SessionManager
from core.stream import Choices, RequestStream
from core.structured_output import ConstraintCompiler
from core.vision import VisionProcessor

log = logging.getLogger(__name__)
DRAIN_POLL_SECONDS = 0.05


class AsyncEngine:
    """The asynchronous engine: every request carries its full context; nothing is kept between them."""

    def __init__(self, backend: Backend, *, chat_template: ChatTemplate | None = None,
                 model_name: str | None = None, vision: VisionProcessor | None = None,
                 media_policy: MediaPolicy | None = None, allow_special_tokens_in_content: bool = False,
                 model_aliases: Sequence[str] = (), chat_template_content_format: str = "auto",
                 constraints: ConstraintCompiler | str | None = None,
                 adapter_policy: AdapterPolicy | None = None) -> None:
        self.backend = backend
        self.adapter_policy = adapter_policy or AdapterPolicy()
        self.model_name = model_name or backend.model_info.name
        #: Every name clients may use: the reported name first, then the aliases.
        self.model_names = tuple(dict.fromkeys((self.model_name, *model_aliases)))
        self.preparer = RequestPreparer(backend.model_info, backend.tokenizer, chat_template, vision, media_policy,
                                        allow_special_tokens_in_content=allow_special_tokens_in_content,
                                        content_format=chat_template_content_format,
                                        constraints=constraints)
        if chat_template is not None:
            log.info("chat template content format: %s", self.preparer.content_format)
        self.sessions = SessionManager(backend)
        self.vision = vision
        self.preparation = PreparationStage(self.preparer, vision)
        self._asleep: set[str] = set()
        self._transition = asyncio.Lock()  # one sleep or wakeup at a time
        self._draining = False
        self._closed = False
        self._pooling = 0  # embed / classify_pairs calls in the backend now (they have no session)

    @classmethod
    def from_config(cls, config: EngineConfig, plugins: Any = None) -> AsyncEngine:
        """Build the backend that `config` names (or the best available one), its chat template, vision
        processor and structured-output engine (core.engine_setup), and the engine over them."""
        from core.engine_setup import engine_parts

        backend, options = engine_parts(config, plugins)
        return cls(backend, **options)

    # -- properties ---------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.backend.model_info

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template chat messages are rendered with (None: the model takes prompts only)."""
        return self.preparer.template

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

    # -- LoRA adapters (core.adapters) ------------------------------------------------------------------

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request's model name may choose now."""
        return tuple(info.name for info in self.backend.adapters())

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load an adapter at run time: the policy must allow it and `path`; a name already served is a 400."""
        module = LoraModule(check_adapter_name(name), self.adapter_policy.check_runtime_path(path))
        if name in self.model_names:
            raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
        self._check_adapters_supported()
        return await self.backend.load_adapter(module)

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter at run time (a 409 while requests use it)."""
        if not self.adapter_policy.runtime_loading:
            raise InvalidRequestError("runtime LoRA loading is off; start the server with --enable-runtime-lora",
                                      param="lora_name")
        self._check_adapters_supported()
        await self.backend.unload_adapter(name)

    def _check_adapters_supported(self) -> None:
        if not self.backend.supports_adapters:
            raise UnsupportedError(f"the {type(self.backend).__name__} backend does not serve LoRA adapters",
                                   param="model")

    # -- generate -----------------------------------------------------------------------------------

    async def prepare(
        self,
        inputs: Inputs,
        config: GenerationConfig | None = None,
        *,
        session_id: str | None = None,
        group: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> PreparedRequest:
        """Prepare one request off the event loop (core.preparation): images fetched and decoded, the
        prompt rendered, preprocessed and tokenized, the limits checked; `generate` then runs it.

        `inputs` is a prompt string, a list of token ids, or OpenAI-style messages; generation fields
        may also be given as keywords (max_new_tokens=8). The session exists from the call on (stamped
        with the epoch), so an abort by id or `stop_all` during preparation ends the request with
        "abort"; a request that fails preparation raises its request error and leaves no session. `group`
        is the id of the request this is one prompt of: aborting that id aborts it too.
        """
        reject_removed_keywords("generate", kwargs)
        self._check_gate()
        config = self._supported(merge_config(config, kwargs))
        session = self.sessions.create(session_id, group)
        try:
            prepared = await self.preparation.prepare(
                inputs, config, add_generation_prompt=add_generation_prompt, tools=tools,
                chat_template_kwargs=chat_template_kwargs)
        except BaseException:
            self.sessions.remove(session)
            raise
        return dataclasses.replace(prepared, session=session)

    def generate(
        self,
        inputs: Inputs | PreparedRequest,
        config: GenerationConfig | None = None,
        *,
        session_id: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Run one request and return its stream of RequestOutputs.

        Given a `PreparedRequest` (from `prepare`), only runs it. Given inputs, it is the convenience
        that prepares them first, here, on the calling thread (what `Pipeline` and scripts use):
        validation is eager, so bad input raises InvalidRequestError (a ValueError naming the field)
        before anything is queued. The removed keywords sequence_start, sequence_end, step and
        interactive raise a TypeError.
        """
        if isinstance(inputs, PreparedRequest):
            session = inputs.session or self.sessions.create(session_id)
            return self._stream(session, dataclasses.replace(inputs, session=session))
        reject_removed_keywords("generate", kwargs)
        self._check_gate()
        prepared = self.preparer.prepare(
            inputs, self._supported(merge_config(config, kwargs)), add_generation_prompt=add_generation_prompt,
            tools=tools, chat_template_kwargs=chat_template_kwargs,
        )
        session = self.sessions.create(session_id)
        return self._stream(session, dataclasses.replace(prepared, session=session))

    def _stream(self, session: Session, prepared: PreparedRequest) -> RequestStream:
        return RequestStream(session, prepared, self._run(session, prepared),
                             forget=functools.partial(self.sessions.remove, session))

    async def tokenize_async(self, inputs: Inputs, *, add_special_tokens: bool = True,
                             **render_options: Any) -> list[int]:
        """`tokenize` off the event loop (images loaded on the media threads); `add_special_tokens`
        False tokenizes a prompt string without the tokenizer's bos."""
        inputs = await self.preparation.load_media(inputs)
        if isinstance(inputs, str) and not add_special_tokens:
            return list(await self.preparation.off_loop(self.tokenizer.encode, inputs, add_special_tokens=False))
        return await self.preparation.off_loop(self.tokenize, inputs, **render_options)

    async def load_media(self, inputs: Inputs) -> Inputs:
        """``inputs`` with their images fetched and decoded off the event loop (`prepare` does this
        itself); a bad image raises the InvalidRequestError naming its field."""
        return await self.preparation.load_media(inputs)

    def _supported(self, config: GenerationConfig) -> GenerationConfig:
        """`config`, or an UnsupportedError for what the backend cannot do."""
        if not self.backend.supports_generation:
            raise UnsupportedError(f"{self.model_name!r} is an encoder-only (embedding) model: it serves "
                                   "/v1/embeddings, /v1/score and /v1/rerank, not generation", param="model")
        if config.adapter is not None:
            self._check_adapters_supported()
            if config.adapter not in self.adapter_names():
                raise ModelNotFoundError(f"no LoRA adapter {config.adapter!r} is loaded", param="model")
        if config.prompt_logprobs is not None and not self.backend.supports_prompt_logprobs:
            raise UnsupportedError(f"the {type(self.backend).__name__} backend does not return prompt logprobs",
                                   param="prompt_logprobs")
        return config

    async def embed(self, inputs: Sequence[str | Sequence[int]]) -> list[Embedding]:
        """One embedding per input (a string, tokenized with the tokenizer's special tokens, or token ids),
        pooled as the backend declares (`Backend.pooling`); an input past the context window is a 400."""
        self._check_gate()
        if self.backend.pooling is None:
            raise UnsupportedError(f"the model {self.model_name!r} does not compute embeddings", param="model")
        if self.backend.pooling.method == "classify":
            raise UnsupportedError(f"the model {self.model_name!r} is a cross-encoder: it scores pairs of texts "
                                   "(/v1/score, /v1/rerank), it computes no embeddings", param="model")
        prompts = [list(p) if not isinstance(p, str) else await self.preparation.off_loop(self.tokenizer.encode, p)
                   for p in inputs]
        return await self._pooled(prompts)

    async def classify_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[Embedding]:
        """A cross-encoder's logits for each (text, text_pair), the two encoded as one input by the tokenizer
        (`Tokenizer.encode(text, text_pair=...)`); an input past the context window is a 400."""
        self._check_gate()
        if self.backend.pooling is None or self.backend.pooling.method != "classify":
            raise UnsupportedError(f"the model {self.model_name!r} is not a cross-encoder", param="model")
        prompts = [list(await self.preparation.off_loop(self.tokenizer.encode, first, text_pair=second))
                   for first, second in pairs]
        return await self._pooled(prompts)

    async def _pooled(self, prompts: list[list[int]]) -> list[Embedding]:
        check_embedding_inputs(prompts, self.model_info.max_model_len, self.model_info.vocab_size)
        self._check_gate()  # again: a sleep may have begun while the texts were tokenized (its epoch is this one)
        epoch = self.sessions.epoch
        self._pooling += 1
        try:
            vectors = await self.backend.embed(prompts)
        except BackendError:
            if self.sessions.epoch == epoch:
                raise
            # A sleep or shutdown (stop_all) aborted the backend's work: its 503 to retry, not a failure.
            self._check_gate()
            raise EngineUnavailableError("the engine was put to sleep while computing; retry") from None
        finally:
            self._pooling -= 1
        return [Embedding(vector, len(prompt)) for vector, prompt in zip(vectors, prompts, strict=True)]

    def _check_gate(self) -> None:
        if self._closed or self._draining:
            raise EngineUnavailableError("the engine is shut down" if self._closed else "the server is shutting down")
        if self.is_sleeping:
            raise EngineSleepingError(self._asleep)

    async def _run(self, session: Session, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        choices = Choices(self.tokenizer, session.id, prepared)
        backend_stream: AsyncIterator[BackendOutput] | None = None
        try:
            request = self._backend_request(session, prepared)
            if prepared.multimodal is not None:
                request = await self._with_image_embeddings(request)
            if self.sessions.is_dropped(session):
                for output in choices.abort_all():  # never reaches the backend
                    yield output
                return
            self._check_gate()
            self.sessions.mark_running(session)
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
            multimodal=prepared.multimodal, constraint=prepared.constraint,
        )

    async def _with_image_embeddings(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with its images encoded by the vision processor (on the vision thread)."""
        inputs = request.multimodal
        if self.vision is None or inputs is None:
            raise BackendError("a request with images reached an engine without a vision processor")
        embeds = await self.preparation.encode_images(inputs)
        return dataclasses.replace(request, multimodal=dataclasses.replace(inputs, image_embeds=embeds))

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

    async def abort(self, session_id: str) -> int:
        """Abort one request by id (every prompt of a request prepared with that `group`); how many were
        aborted (0: no such request is in flight)."""
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

    @property
    def requests_in_flight(self) -> int:
        """Generation requests (sessions) and embedding / scoring calls in the backend now."""
        return len(self.sessions) + self._pooling

    async def drain(self, timeout: float) -> int:
        """Stop accepting requests (EngineUnavailableError), let those in flight (embeddings and scores
        too) finish for up to `timeout` seconds, then abort the rest; returns how many generation requests
        were aborted. For a graceful shutdown."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.requests_in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if not self.requests_in_flight:
            return 0
        return await (self.stop_all() if self._pooling else self.abort_all())  # stop_all reaches the pooling too

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
        self.preparation.close()
