"""Embeddings from a generating model: one prefill-only request's pooling as its chunks are computed.

Such a request runs through the paged runner like any prompt, but it never samples: the runner keeps the
final (normed) hidden states of the positions its pooling needs (`positions`: all of them for mean, the
first for cls, the last for last-token pooling), this object collects them chunk by chunk, and the engine
loop ends the sequence (its blocks freed) with the prompt's last chunk. Only last-token pooling may read
the prefix cache: the last token is always computed, the positions of a cached prefix never are.
"""

from __future__ import annotations

import torch

from core.pooling import PoolingConfig
from core_pytorch_backend.pooling_runner import pool


class PooledPrompt:
    """The hidden states one request pools, gathered in position order; `vector()` once `complete`."""

    def __init__(self, config: PoolingConfig, num_tokens: int) -> None:
        self.config = config
        first = num_tokens - 1 if config.method == "last" else 0
        self.positions = range(first, 1 if config.method == "cls" else num_tokens)
        self.next_position = first
        self._rows: list[torch.Tensor] = []

    @property
    def reads_prefix_cache(self) -> bool:
        return self.config.method == "last"

    @property
    def complete(self) -> bool:
        return self.next_position == self.positions.stop

    def add(self, first_position: int, hidden: torch.Tensor) -> None:
        """Rows of positions first_position, first_position + 1, ...; positions already added (a
        recompute after a preemption) are skipped."""
        skip = self.next_position - first_position
        if skip < 0:
            raise RuntimeError(f"pooling rows from position {first_position} leave a gap at {self.next_position}")
        if skip < hidden.shape[0]:
            self._rows.append(hidden[skip:])
            self.next_position = first_position + hidden.shape[0]

    def vector(self) -> list[float]:
        """The pooled (and, when configured, L2-normalised) float32 vector."""
        if not self.complete:
            raise RuntimeError(f"pooling incomplete: positions up to {self.next_position} of {self.positions}")
        rows = torch.cat(self._rows)[None]
        return pool(rows, torch.ones(rows.shape[:2], device=rows.device), self.config)[0].tolist()
