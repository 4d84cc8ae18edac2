"""The pooling path: an encoder's forward passes and pooling, batched on one thread of their own.

No KV cache and no scheduler: each request's prompts are complete, so a batch is just its prompts
right-padded to the longest. Requests that arrive while a batch runs wait on the `core-pooling` thread and
go together in the next batch (sorted by length, cut at `max_batch_tokens` padded tokens), so concurrent
clients share forward passes the way continuous batching shares decode steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from core.pooling import PoolingConfig

Job = tuple[Sequence[Sequence[int]], concurrent.futures.Future]


def pool(hidden: torch.Tensor, mask: torch.Tensor, config: PoolingConfig, projection: nn.Module | None = None
         ) -> torch.Tensor:
    """One vector per row of a right-padded batch's hidden states [batch, length, hidden], in float32 (a
    cross-encoder's output, [batch, labels], is its vectors already); ``projection`` (the checkpoint's Dense
    modules, float32) maps it before the normalisation."""
    hidden, mask = hidden.float(), mask.to(torch.float32)
    if config.method == "classify":
        return hidden
    if config.method == "mean":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
    elif config.method == "cls":
        pooled = hidden[:, 0]
    else:
        last = mask.sum(1).long() - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if projection is not None:
        pooled = projection(pooled)
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled


class PoolingRunner:
    """Embeds prompts with an encoder (`model(input_ids, attention_mask) -> hidden states`)."""

    def __init__(self, model: nn.Module, pooling: PoolingConfig, device: torch.device, pad_token_id: int = 0,
                 max_batch_tokens: int = 16384, projection: nn.Module | None = None) -> None:
        self.model, self.pooling, self.device, self.projection = model, pooling, device, projection
        self.pad_token_id, self.max_batch_tokens = pad_token_id, max_batch_tokens
        self._queue: list[Job] = []
        self._lock = threading.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core-pooling")

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The pooled vectors of `prompts`, computed with whatever else is queued meanwhile."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queue.append((prompts, future))
        self._thread.submit(self._run_queued)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _run_queued(self) -> None:
        with self._lock:
            jobs, self._queue = self._queue, []
        if not jobs:
            return  # an earlier call took them
        prompts = [p for job, _ in jobs for p in job]
        try:
            vectors = self.run(prompts)
        except Exception as exc:  # every waiting request gets the failure
            for _, future in jobs:
                future.set_exception(exc)
            return
        start = 0
        for job, future in jobs:
            future.set_result(vectors[start:start + len(job)])
            start += len(job)

    def run(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The vectors of `prompts` in order (shortest first in batches of at most max_batch_tokens)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        vectors: list[list[float]] = [[] for _ in prompts]
        batch: list[int] = []
        for i in order:
            if batch and len(prompts[i]) * (len(batch) + 1) > self.max_batch_tokens:
                self._run_batch(prompts, batch, vectors)
                batch = []
            batch.append(i)
        if batch:
            self._run_batch(prompts, batch, vectors)
        return vectors

    @torch.inference_mode()
    def _run_batch(self, prompts: Sequence[Sequence[int]], batch: list[int], vectors: list[list[float]]) -> None:
        length = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, :len(prompts[i])] = torch.tensor(prompts[i], dtype=torch.long)
            mask[row, :len(prompts[i])] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pooled = pool(self.model(ids, mask), mask, self.pooling, self.projection).cpu().tolist()
        for row, i in enumerate(batch):
            vectors[i] = pooled[row]
