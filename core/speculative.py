"""Speculative decoding's contract: the engine option (`SpeculativeConfig`), the proposer interface a
plugin implements (`Proposer`, registered through ``core_register_speculative_proposers``) and the
counters a backend reports (`SpecDecodeStats`).

A proposer guesses the next tokens of a sequence cheaply; the backend scores the guesses with the target
model in one forward pass and keeps the longest prefix the target agrees with, plus the target's own next
token, so the output is the target's whatever the guesses (exact under greedy decoding; the same
distribution under sampling). Nothing here imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.errors import InvalidRequestError

#: The most tokens one row may propose per step (each is a query row of the verifying forward pass).
MAX_SPECULATIVE_TOKENS = 32


def _fail(name: str, value: object, expected: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {expected}, got {value!r}", param=name)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(name, value, f"an integer between {low} and {high}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates (`EngineConfig.speculative`; None: it does not).

    :param method: the registered proposer's name: "ngram" (prompt lookup), or a plugin's.
    :param num_speculative_tokens: the most tokens proposed for one row per step (K).
    :param ngram_min: the shortest suffix the n-gram proposer matches (N).
    :param ngram_max: the longest suffix it tries first (M).
    :param draft_model: a smaller model of the same tokenizer, for a draft-model proposer.
    :param backoff: fit each row's draft length to its measured acceptance, and pause its proposals
        while they cost more than they give (core.scheduling.speculation.AcceptanceBackoff); off: always
        propose up to ``num_speculative_tokens``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 8
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    backoff: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise _fail("speculative", self.method, "a proposer name such as 'ngram'")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("ngram_min", self.ngram_min, 1, 64)
        _check_int("ngram_max", self.ngram_max, 1, 64)
        if self.ngram_min > self.ngram_max:
            raise InvalidRequestError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})", param="ngram_min")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise _fail("draft_model", self.draft_model, "a path")
        if not isinstance(self.backoff, bool):
            raise _fail("speculative_backoff", self.backoff, "true or false")


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to propose for: its id, all its tokens so far (prompt and output) and how many
    tokens at most to propose."""

    seq_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_tokens: int


class Proposer(ABC):
    """Proposes draft tokens for a batch of sequences; made by a registered factory
    ``factory(config: SpeculativeConfig) -> Proposer``.

    The backend calls `propose` once per step with every row that may speculate; an empty list means
    "nothing to propose" (the row decodes one token as usual). Proposals only cost speed when wrong,
    never correctness. A proposer that keeps per-sequence state (a draft model's KV) frees it in
    `release`, called when the sequence ends or loses its KV (preemption).
    """

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """At most ``request.max_tokens`` tokens for each request, in order."""

    def release(self, seq_id: str) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Forget whatever is kept for `seq_id`."""


@dataclass
class SpecDecodeStats:
    """Counters since start (names as vLLM's ``spec_decode_*``): rows that verified a proposal, tokens
    proposed, tokens accepted, and accepted tokens by their position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verified row: `proposed` tokens, of which the first `accepted` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))
