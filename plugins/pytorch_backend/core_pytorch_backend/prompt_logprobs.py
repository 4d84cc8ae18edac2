"""Prompt logprobs: how likely the model found each prompt token, from the logits of the position before.

A request asking for them (GenerationConfig.prompt_logprobs = k) gets one entry per prompt token: None for
the first (nothing precedes it), then the token's logprob, its rank in the vocabulary (1 = the likeliest)
and the k likeliest tokens. They come from the raw logits (log-softmax in float32), as vLLM reports them.

A prefix served from the cache has no logits, so such a request does not read the prefix cache (its own
blocks are still offered to it); a sequence recomputed after a preemption scores no position twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from core.backend import TokenLogprob

ROWS_PER_SLICE = 256  # logits [rows, vocab] are made this many rows at a time to bound memory


@torch.inference_mode()
def score_tokens(hidden: torch.Tensor, targets: Sequence[int], k: int,
                 logits_of: Callable[[torch.Tensor], torch.Tensor]) -> list[TokenLogprob]:
    """Row i of `hidden` scored against token `targets[i]`: its logprob, rank and the top `k`."""
    scored: list[TokenLogprob] = []
    for start in range(0, len(targets), ROWS_PER_SLICE):
        rows = hidden[start : start + ROWS_PER_SLICE]
        scored.extend(_score_slice(logits_of(rows), targets[start : start + ROWS_PER_SLICE], k))
    return scored


def _score_slice(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])
    ranks = (logprobs > chosen).sum(-1).add_(1).tolist()
    top_values, top_ids = [[]] * len(targets), [[]] * len(targets)
    if k > 0:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprob(t, lp, tuple(zip(i, v, strict=True)), rank)
            for t, lp, i, v, rank in zip(targets, chosen.squeeze(-1).tolist(), top_ids, top_values, ranks, strict=True)]


class PromptScores:
    """One request's prompt logprobs as its chunks are computed: entry j scores prompt token j."""

    def __init__(self, prompt: Sequence[int], k: int) -> None:
        self.prompt = list(prompt)
        self.k = k
        self.entries: list[TokenLogprob | None] = [None]

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.prompt)

    def next_position(self) -> int:
        """The prompt position whose row scores the next missing entry."""
        return len(self.entries) - 1

    def add(self, first_position: int, scored: Sequence[TokenLogprob]) -> None:
        """Entries scored from positions first_position, first_position + 1, ...; positions already
        scored (a recompute after a preemption) are skipped."""
        skip = self.next_position() - first_position
        if skip >= 0:
            self.entries.extend(scored[skip:])

    def targets(self, first_position: int, count: int) -> list[int]:
        """The prompt tokens that rows of positions [first_position, first_position + count) score."""
        return self.prompt[first_position + 1 : first_position + 1 + count]
