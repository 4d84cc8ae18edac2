"""The backend contract: what every inference backend implements.

A backend owns a model, its tokenizer and its KV cache. The engine hands it fully-prepared, stateless
requests (token ids plus a resolved GenerationConfig) and reads back token ids; detokenization, stop
strings, sessions and the sleep gate live in the engine, so every backend behaves the same.

There is no sequence_start, sequence_end or step: each request carries its whole context.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.adapters import AdapterInfo, LoraModule
from core.config import GenerationConfig
from core.errors import UnsupportedError
from core.pooling import PoolingConfig
from core.speculative import SpecDecodeStats

WAKE_TAGS = frozenset({"weights", "kv_cache"})


class FinishReason(str, enum.Enum):
    """Why a generation ended. Values are the OpenAI finish_reason strings."""

    STOP = "stop"  # an eos/stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context window
    ABORT = "abort"  # aborted: by the caller, stop_all or sleep
    ERROR = "error"  # the backend failed for this request


class EndResult(enum.Enum):
    """The backend's confirmation of `end(session_id)`."""

    ENDED = "ended"
    NOT_FOUND = "not_found"


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer; Hugging Face tokenizers satisfy it as they are."""

    eos_token_id: int | None
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; a cross-encoder's tokenizer also takes a second text (``encode(text,
        text_pair=...)``, as Hugging Face tokenizers do) and encodes the two as one input."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that the engine and the server need.

    :param generation_defaults: the model's generation_config.json sampling values (temperature,
        top_p, top_k, min_p, repetition_penalty), used when a request leaves them unset.
    """

    name: str
    architecture: str
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    vocab_size: int = 0
    quantization: str = "none"  # how the weights are kept, in words (e.g. "int4 x120")


@dataclass(frozen=True)
class GenerateRequest:
    """One stateless request, ready for the backend.

    :param stop_token_ids: every token id that ends generation (the model's eos ids unless
        ignore_eos, plus config.stop_token_ids); generation never stops on them before
        config.min_new_tokens.
    :param max_new_tokens: already resolved against the context window.
    :param multimodal: opaque inputs a vision processor prepared (embeddings, placeholder ranges).
    :param constraint: the compiled `config.structured_output` (a core.structured_output.Constraint),
        or None; each choice takes its own matcher from it.
    """

    session_id: str
    prompt_token_ids: Sequence[int]
    config: GenerationConfig
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    multimodal: Any = None
    constraint: Any = None


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one token (generated, or of the prompt) and the most likely alternatives, descending.

    `rank` is the token's place in the vocabulary by logprob (1 = the likeliest), where the backend
    reports it (prompt logprobs do).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class BackendOutput:
    """New tokens of one choice (index < n) since the previous output.

    `prompt_logprobs` comes once, on the request's first output, when its config asks for
    prompt_logprobs: one entry per prompt token, the first None (nothing precedes it), each with the
    `config.prompt_logprobs` likeliest tokens in `top`.
    """

    token_ids: Sequence[int]
    index: int = 0
    finish_reason: FinishReason | None = None
    logprobs: Sequence[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class BackendStats:
    """A snapshot for metrics and leak checks: everything must return to zero when idle."""

    running: int = 0
    waiting: int = 0
    sessions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    is_sleeping: bool = False
    # speculative decoding (core.speculative.SpecDecodeStats); None: the backend does not speculate
    spec_decode: SpecDecodeStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Backend(ABC):
    """An inference backend. Implementations register a factory through `core_register_backends`.

    Lifecycle of a request: `generate` yields outputs until each choice has a finish_reason (or the
    caller stops iterating); `abort` makes an in-flight `generate` finish promptly with ABORT and frees
    its KV blocks; `end` releases whatever the backend still holds for the session and confirms it.
    The engine calls `end` exactly once per request that reached the backend.
    """

    model_info: ModelInfo
    tokenizer: Tokenizer
    #: Whether the backend returns prompt logprobs (BackendOutput.prompt_logprobs); the engine refuses
    #: requests asking for them with a 400 otherwise.
    supports_prompt_logprobs: bool = False
    #: Whether the backend applies `GenerateRequest.constraint` (structured output); the engine refuses
    #: constrained requests with a 400 otherwise.
    supports_structured_output: bool = False
    #: Whether the backend generates text. An encoder-only model's does not (it only pools): the engine
    #: refuses generation requests with a 400.
    supports_generation: bool = True
    #: How the model pools hidden states into embeddings (core.pooling), or None: it serves none.
    pooling: PoolingConfig | None = None
    #: Whether the backend runs requests through LoRA adapters (`GenerationConfig.adapter`, core.adapters);
    #: the engine refuses requests naming one, and loading one, with a 400 otherwise.
    supports_adapters: bool = False
    #: Whether the backend speculates when `EngineConfig.speculative` asks it to (core.speculative); the
    #: engine refuses to start with --speculative otherwise.
    supports_speculative_decoding: bool = False

    def adapters(self) -> Sequence[AdapterInfo]:
        """The adapters loaded now (none unless `supports_adapters`)."""
        return ()

    async def load_adapter(self, module: LoraModule) -> AdapterInfo:
        """Load `module` (its path already checked against the policy); a 400 naming the field for a bad
        folder, and nothing of it stays loaded. The default refuses."""
        raise UnsupportedError(f"the {type(self).__name__} backend does not serve LoRA adapters", param="model")

    async def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`: a 404 if unknown, a 409 (AdapterInUseError) while requests use it."""
        raise UnsupportedError(f"the {type(self).__name__} backend does not serve LoRA adapters", param="model")

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """One pooled vector per prompt (token ids, each within the context window), as `pooling` says,
        not truncated. The default refuses: a backend that sets `pooling` overrides it."""
        raise UnsupportedError(f"the {type(self).__name__} backend does not compute embeddings")

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        """Stream outputs for `request`; raise `core.errors.CoreError` subclasses on failure."""

    @abstractmethod
    async def abort(self, session_id: str) -> None:
        """Stop the session's work now and free its KV blocks; a no-op for unknown sessions."""

    async def abort_many(self, session_ids: Sequence[str]) -> None:
        """`abort` for each of `session_ids` (abort-all, sleep, shutdown), done together.

        The default aborts them concurrently. A backend whose commands wait for an engine step
        overrides it to abort them all in one command, so aborting N requests takes one step, not N.
        """
        await asyncio.gather(*(self.abort(session_id) for session_id in session_ids))

    @abstractmethod
    async def end(self, session_id: str) -> EndResult:
        """Release the session; ENDED if the backend knew it, NOT_FOUND otherwise (never raises)."""

    @abstractmethod
    async def sleep(self, level: int) -> None:
        """Free memory: level 1 drops the KV cache and moves weights to host memory; 2 drops both."""

    @abstractmethod
    async def wakeup(self, tags: Sequence[str]) -> None:
        """Restore the parts named by tags ("weights", "kv_cache")."""

    @property
    @abstractmethod
    def is_sleeping(self) -> bool:
        """True while any part is asleep."""

    @abstractmethod
    def stats(self) -> BackendStats:
        """Current counters; cheap enough to call on every /metrics scrape."""

    async def close(self) -> None:  # noqa: B027 - a backend without resources needs no close
        """Stop background work and release all memory. Idempotent."""
