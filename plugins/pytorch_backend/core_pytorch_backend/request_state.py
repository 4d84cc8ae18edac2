"""Per-request state of the engine loop: its sequences (one per choice), sampling and stop rules.

Lives on the loop thread; outputs reach the request's asyncio loop through call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from core.backend import BackendOutput, FinishReason, GenerateRequest, TokenLogprob
from core.scheduling import Sequence
from core_pytorch_backend.prompt_logprobs import PromptScores
from core_pytorch_backend.sampling import SamplingParams, TokenLogprobs, make_generator

END_OF_STREAM = object()


def sampling_params(request: GenerateRequest) -> SamplingParams:
    """The sampler's view of a request's resolved GenerationConfig."""
    cfg = request.config
    return SamplingParams(
        temperature=cfg.temperature or 0.0, top_k=cfg.top_k or 0, top_p=cfg.top_p or 1.0, min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty or 1.0, presence_penalty=cfg.presence_penalty,
        frequency_penalty=cfg.frequency_penalty, seed=cfg.seed,
        logprobs=cfg.top_logprobs if cfg.logprobs else None, logit_bias=dict(cfg.logit_bias) or None,
    )


@dataclass
class RequestState:
    """One request on the loop thread. `sequences[i]` is choice i (created by forking choice 0)."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    params: SamplingParams
    max_model_len: int
    sequences: dict[int, Sequence] = field(default_factory=dict)
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    open_choices: set[int] = field(default_factory=set)
    forked: bool = False
    prompt_scores: PromptScores | None = None  # while prompt logprobs are asked for and not yet sent

    def __post_init__(self) -> None:
        k = self.request.config.prompt_logprobs
        if k is not None:
            self.prompt_scores = PromptScores(self.request.prompt_token_ids, k)

    @property
    def session_id(self) -> str:
        return self.request.session_id

    @property
    def n(self) -> int:
        return self.request.config.n

    def generator(self, index: int, device: torch.device) -> torch.Generator | None:
        """Choice i's own generator (seed + i), created once, so seeded output ignores the batch."""
        if index not in self.generators:
            seed = self.params.seed
            sampled = not self.params.greedy
            self.generators[index] = make_generator(seed + index, device) if seed is not None and sampled else None
        return self.generators[index]

    def banned(self, seq: Sequence) -> tuple[int, ...]:
        """Stop tokens are not allowed before min_new_tokens."""
        if seq.num_output_tokens < self.request.config.min_new_tokens:
            return tuple(self.request.stop_token_ids)
        return ()

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in self.request.stop_token_ids and seq.num_output_tokens > self.request.config.min_new_tokens - 1:
            return FinishReason.STOP
        if seq.num_output_tokens >= self.request.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def output(self, index: int, token: int, finish: FinishReason | None, logprobs: TokenLogprobs | None) -> BackendOutput:
        seq = self.sequences[index]
        converted = None
        if logprobs is not None:
            converted = [TokenLogprob(logprobs.token_id, logprobs.logprob, tuple(logprobs.top))]
        return BackendOutput([token], index=index, finish_reason=finish, logprobs=converted,
                             num_cached_tokens=seq.num_cached_tokens,
                             stop_token_id=token if finish is FinishReason.STOP else None,
                             prompt_logprobs=self._take_prompt_logprobs())

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs, once (with the first output), when they are asked for."""
        scores, self.prompt_scores = self.prompt_scores, None
        if scores is None:
            return None
        if not scores.complete:
            raise RuntimeError(f"{self.session_id}: prompt logprobs incomplete at the first output")
        return scores.entries

    def send(self, item: Any) -> None:
        """Hand an output (or an exception, or END_OF_STREAM) to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def close_choice(self, index: int, reason: FinishReason) -> None:
        self.send(BackendOutput([], index=index, finish_reason=reason))
        self.open_choices.discard(index)
