"""The draft-model proposer (``--speculative draft --draft-model PATH``): a smaller model of the same
tokenizer drafts greedily, k steps per proposal, over a paged KV cache of its own kept in step with the
target's sequences.

Each row has a mirror `Sequence` in the draft's own block manager. A proposal first brings the mirror to
the target's tokens: the longest common prefix keeps its KV (the drafts the target rejected are dropped,
`BlockManager.trim`), the rest is computed in one chunk, whose last logits give the first draft; then
k - 1 one-token steps give the others. All rows of a step run together, in the draft's own forward passes
(on the engine loop's thread, before the target's step). Drafting is greedy, so the draft distribution
is one-hot and the target's verification stays exact (speculative/decoder.py). A row whose draft KV
does not fit gets no proposal this step. The draft cache is not released by sleep (it is small).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from core.scheduling import BlockManager, ScheduledSequence
from core.scheduling import Sequence as Seq
from core.speculative import DraftRequest, Proposer, SpeculativeConfig

log = logging.getLogger(__name__)
DRAFT_KV_CACHE_GIB = 0.25


class DraftModelProposer(Proposer):
    """Greedy drafts of a small model over its own paged KV cache (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner  # a ModelRunner over the draft model
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False,
                                   lazy_memory=runner.kv_memory_is_lazy)
        self.mirrors: dict[str, Seq] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.seq_id: [] for r in requests}
        live = [r for r in requests if self._sync(r)]
        for _ in range(max((r.max_tokens for r in live), default=0)):
            rows = [r for r in live if len(drafts[r.seq_id]) < r.max_tokens and self._room(r.seq_id)]
            if not rows:
                break
            tokens = self._next_tokens([self.mirrors[r.seq_id] for r in rows])
            for request, token in zip(rows, tokens, strict=True):
                drafts[request.seq_id].append(token)
                self.mirrors[request.seq_id].append_token(token)
        return [drafts[r.seq_id] for r in requests]

    def release(self, seq_id: str) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.blocks.free(mirror)

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks

    def _sync(self, request: DraftRequest) -> bool:
        """Bring the row's mirror to the target's tokens, keeping the KV of their common prefix."""
        tokens = list(request.token_ids)
        mirror = self.mirrors.get(request.seq_id)
        if mirror is None:
            mirror = self.mirrors[request.seq_id] = Seq(f"draft:{request.seq_id}", tokens)
        common = _common_prefix(mirror.token_ids, tokens)
        mirror.token_ids = tokens
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, common, len(tokens) - 1)
        self.blocks.trim(mirror)
        return True

    def _room(self, seq_id: str) -> bool:
        """Blocks for the mirror's uncomputed tokens; a row that finds none stops drafting this step."""
        mirror = self.mirrors[seq_id]
        return self.blocks.allocate(mirror, mirror.num_tokens - mirror.num_computed_tokens)

    @torch.inference_mode()
    def _next_tokens(self, mirrors: list[Seq]) -> list[int]:
        """One forward pass of the draft over each mirror's uncomputed tokens; each one's greedy next."""
        chunks = [ScheduledSequence(m, m.num_tokens - m.num_computed_tokens) for m in mirrors]
        logits = self.runner.forward(self.runner.prepare(chunks)).sample
        for mirror in mirrors:
            mirror.num_computed_tokens = mirror.num_tokens
        return logits.argmax(dim=-1).tolist()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def make_draft_proposer(config: SpeculativeConfig) -> DraftModelProposer:
    """The registered factory of "draft": loads ``config.draft_model`` on the default device."""
    from core_pytorch_backend.backend import architectures_for, resolve_device
    from core_pytorch_backend.kernels import select_ops
    from core_pytorch_backend.loader import load_checkpoint
    from core_pytorch_backend.model_runner import ModelRunner, kv_cache_blocks

    if not config.draft_model:
        from core.errors import InvalidRequestError

        raise InvalidRequestError("--speculative draft needs --draft-model PATH", param="draft_model")
    device = resolve_device(None)
    loaded = load_checkpoint(config.draft_model, device=device, architectures=architectures_for("pytorch"),
                             ops=select_ops(device))
    block_size = 16
    num_blocks = kv_cache_blocks(loaded.model, block_size, loaded.kv_cache_dtype, device,
                                 DRAFT_KV_CACHE_GIB, 0.05)
    runner = ModelRunner(loaded.model, block_size=block_size, num_blocks=num_blocks, device=device,
                         dtype=loaded.dtype, kv_cache_dtype=loaded.kv_cache_dtype)
    log.info("draft model %s: %d KV blocks on %s", config.draft_model, num_blocks, device)
    return DraftModelProposer(runner)
