"""Speculative decoding's pure rules: which verified tokens a row keeps, and when a row stops proposing.

Verification samples the target model at every verified position (position j sees the row's tokens
plus drafts ``0..j-1``) and keeps the longest prefix of drafts that equals what was sampled, then the
first sampled token that differs (or the one after the last draft). Under greedy decoding that is what
decoding one token at a time gives. Under sampling it is the standard rejection sampling for a one-hot
draft distribution (any deterministic proposer: n-gram lookup, a greedy draft model): a draft ``d`` is
kept with probability ``p(d)``, and a rejection yields a token from ``p`` without ``d``, renormalised,
so every emitted token has exactly the target's distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def accepted_length(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the target agrees with: ``sampled[j]`` is the token the target chose at
    the position whose next token ``drafts[j]`` guessed (``len(sampled) == len(drafts) + 1``)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def verified_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified row emits: its accepted drafts, then the target's next token."""
    accepted = accepted_length(drafts, sampled)
    return [*drafts[:accepted], sampled[accepted]]


#: What verifying one more token costs, as a share of a plain decode step, for one stream: measured on the
#: default model on the CPU (AMD EPYC, AVX-512, 2 threads): a step verifying 4 drafts took 1.75x a plain
#: step, one verifying 8 took 2.3x. A GPU, bound by reading the weights, pays less.
DRAFT_TOKEN_COST = 0.2


def draft_token_cost(batch: int, single: float = DRAFT_TOKEN_COST) -> float:
    """The cost of one more verified token in a step of `batch` decoding rows, in tokens that step gives
    up: larger batches are closer to compute-bound, so an extra query row costs them more. Fitted to the
    same measurements: ``single`` for one stream, twice that for 8 (8 rows verifying 4 drafts each took
    2.7x a plain step of 8), growing with log2 of the batch."""
    return single * (1 + math.log2(max(batch, 1)) / 3)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a row emits from a proposal of `k` drafts each accepted with probability `rate` (given the
    ones before): the accepted prefix plus the target's own next token, ``1 + rate + ... + rate**k``."""
    return sum(rate**j for j in range(k + 1))


def best_draft_length(rate: float, limit: int, cost: float = DRAFT_TOKEN_COST) -> int:
    """The number of drafts (0..limit) that maximises expected tokens per unit of step time, where a
    step verifying k drafts costs ``1 + cost * k`` plain steps; 0 when no proposal pays for itself."""
    best, best_value = 0, 1.0
    for k in range(1, limit + 1):
        value = expected_tokens(rate, k) / (1 + cost * k)
        if value > best_value:
            best, best_value = k, value
    return best


@dataclass
class AcceptanceBackoff:
    """One row's draft length, from its measured acceptance: long runs while drafts are accepted, short
    ones when they are half right, none (a pause) when proposals cost more than they give.

    `rate` estimates the chance that a draft is accepted given that the ones before it were: each
    verified proposal adds its accepted drafts as successes and its first rejected one (if any) as a
    failure, in exponentially decayed sums (`decay` per proposal) over an optimistic prior of one success.
    `draft_length` picks `best_draft_length` for it; when that is 0 the row decodes plainly for `pause`
    steps, then probes again from `probe_rate`; each failed probe doubles the pause (up to `max_pause`), an
    accepted draft resets it.
    """

    cost: float = DRAFT_TOKEN_COST
    decay: float = 0.7
    probe_rate: float = 0.5
    min_pause: int = 4
    max_pause: int = 128
    successes: float = field(default=1.0, init=False)
    trials: float = field(default=1.0, init=False)
    pause: int = field(default=0, init=False)
    pause_left: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.pause = self.min_pause

    @property
    def rate(self) -> float:
        return self.successes / self.trials

    def draft_length(self, limit: int, cost: float | None = None) -> int:
        """How many tokens the row may propose this step (0: it decodes plainly; a paused row counts it);
        `cost` of a verified token this step (default: `self.cost`)."""
        if self.pause_left > 0:
            self.pause_left -= 1
            return 0
        k = best_draft_length(self.rate, limit, self.cost if cost is None else cost)
        if k == 0 and limit > 0:
            self.pause_left = self.pause - 1  # this step is the pause's first
            self.pause = min(2 * self.pause, self.max_pause)
            self.successes, self.trials = self.probe_rate, 1.0
        return k

    def record(self, proposed: int, accepted: int) -> None:
        """A verified proposal of `proposed` tokens, `accepted` of them kept."""
        if proposed <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < proposed else 0)
        if accepted:
            self.pause = self.min_pause
