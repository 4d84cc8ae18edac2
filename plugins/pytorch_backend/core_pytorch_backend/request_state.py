"""Per-request state of the engine loop: its sequences (one per choice), sampling and stop rules (or,
for an embedding request, the pooling of its prompt).

Lives on the loop thread; outputs reach the request's asyncio loop through its channel (core.channel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from core.backend import BackendOutput, FinishReason, GenerateRequest, TokenLogprob
from core.channel import LoopChannel
from core.scheduling import Sequence
from core.structured_output import ConstraintMatcher
from core_pytorch_backend.pooled_prompt import PooledPrompt
from core_pytorch_backend.prompt_logprobs import PromptScores
from core_pytorch_backend.sampling_batch import SamplingParams, make_generator


@dataclass
class RequestState:
    """One request on the loop thread. `sequences[i]` is choice i (created by forking choice 0)."""

    request: GenerateRequest
    channel: LoopChannel  # to the request's event loop: outputs, an exception, then the end
    params: SamplingParams
    max_model_len: int
    sequences: dict[int, Sequence] = field(default_factory=dict)
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    open_choices: set[int] = field(default_factory=set)
    forked: bool = False
    prompt_scores: PromptScores | None = None  # while prompt logprobs are asked for and not yet sent
    matchers: dict[int, ConstraintMatcher] = field(default_factory=dict)  # structured output, per choice
    pooling: PooledPrompt | None = None  # an embedding request: prefill only, its hidden states pooled

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

    def matcher(self, index: int) -> ConstraintMatcher | None:
        """Choice i's own matcher of the request's constraint (None: unconstrained), created once, on its
        first sample, or with a reasoning model (`Constraint.starts_after`) on the first sample after its
        output ends with the end of reasoning. It follows the choice's sampled tokens only, so preemption
        (the KV recomputed) leaves it as it is."""
        constraint = self.request.constraint
        if constraint is None:
            return None
        if index not in self.matchers:
            if not self._reasoning_ended(index, constraint.starts_after):
                return None
            self.matchers[index] = constraint.matcher(self.request.stop_token_ids)
        return self.matchers[index]

    def _reasoning_ended(self, index: int, marker: tuple[int, ...]) -> bool:
        """Whether choice i's output ends with `marker` (always, for no marker)."""
        if not marker:
            return True
        seq = self.sequences.get(index)
        if seq is None or seq.num_output_tokens < len(marker):
            return False
        return tuple(seq.token_ids[-len(marker):]) == marker

    def constrain(self, index: int, token: int) -> FinishReason | None:
        """Advance choice i's matcher past `token`: STOP once the constraint is complete, LENGTH when the
        token was not allowed (only when the constraint can no longer be met, e.g. its stop token is
        banned before min_new_tokens). A choice still reasoning has no matcher yet: nothing to advance."""
        matcher = self.matchers.get(index)
        if matcher is None:
            return None
        if not matcher.accept_token(token):
            return FinishReason.LENGTH
        return FinishReason.STOP if matcher.is_terminated() else None

    def banned(self, seq: Sequence) -> tuple[int, ...]:
        """Stop tokens are not allowed before min_new_tokens."""
        return self.banned_at(seq.num_output_tokens)

    def banned_at(self, num_output_tokens: int) -> tuple[int, ...]:
        """The tokens banned for the next token of a choice that has generated `num_output_tokens`."""
        if num_output_tokens < self.request.config.min_new_tokens:
            return tuple(self.request.stop_token_ids)
        return ()

    def finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        return self.finish_reason_at(seq.num_output_tokens, seq.num_tokens, token)

    def finish_reason_at(self, num_output_tokens: int, num_tokens: int, token: int) -> FinishReason | None:
        """Why a choice ends with `token`, its output then `num_output_tokens` long (`num_tokens` in all)."""
        if token in self.request.stop_token_ids and num_output_tokens > self.request.config.min_new_tokens - 1:
            return FinishReason.STOP
        if num_output_tokens >= self.request.max_new_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def output(self, index: int, token: int, finish: FinishReason | None, logprobs: TokenLogprob | None) -> BackendOutput:
        seq = self.sequences[index]
        return BackendOutput([token], index=index, finish_reason=finish,
                             logprobs=[logprobs] if logprobs is not None else None,
                             num_cached_tokens=seq.num_cached_tokens,
                             stop_token_id=token if finish is FinishReason.STOP and token in self.request.stop_token_ids
                             else None,
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
        """Hand an output (or an exception) to the request's event loop."""
        self.channel.send(item)

    def end_stream(self) -> None:
        """No more outputs: the request's stream ends."""
        self.channel.close()

    def close_choice(self, index: int, reason: FinishReason) -> None:
        self.send(BackendOutput([], index=index, finish_reason=reason))
        self.open_choices.discard(index)
