"""What one forward pass takes and gives: the flat batch of a step (`StepInputs`), the rows of it whose
hidden states a request keeps (`PromptRows`: to score prompt tokens, or to pool them into an embedding),
and the logits and hidden states it returns (`StepLogits`); `narrowed` cuts both down to some of the step's
sequences (the engine loop computes a failed step's outputs request by request).

Shared by the model runner, which builds and runs them, and by the parts that fill or replay a step
(multimodal_inputs.py, cuda_graphs.py); it imports none of them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from core.scheduling import ScheduledSequence
from core_pytorch_backend.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class PromptRows:
    """Rows of a step's hidden states that a request keeps: row ``first_row + j`` holds position
    ``first_position + j`` of `seq_id` (for prompt logprobs, its logits give the logprob of prompt token
    ``first_position + j + 1``; for pooling, it is one of the positions pooled)."""

    seq_id: str
    first_row: int
    first_position: int
    count: int


def prompt_rows_of(chunk: ScheduledSequence, first_row: int) -> PromptRows | None:
    """The rows of `chunk` (starting at `first_row` of the step) that score a next prompt token."""
    return rows_in(chunk, first_row, range(chunk.seq.num_prompt_tokens - 1))


def rows_in(chunk: ScheduledSequence, first_row: int, positions: range) -> PromptRows | None:
    """The rows of `chunk` (starting at `first_row` of the step) whose positions lie in `positions`."""
    start = max(chunk.start, positions.start)
    end = min(chunk.start + chunk.num_new_tokens, positions.stop)
    if end <= start:
        return None
    return PromptRows(chunk.seq.seq_id, first_row + start - chunk.start, start, end - start)


@dataclass(frozen=True)
class StepInputs:
    """The flat batch of one forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the hidden states whose logits are needed
    sampling: list[ScheduledSequence]  # in the order of sample_indices
    # (rows, values): image embeddings replacing token embeddings (see multimodal_inputs)
    embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_rows: tuple[PromptRows, ...] = ()  # in row order
    lora_rows: tuple[int, ...] | None = None  # each row's LoRA slot (-1: the base), None: no adapter this step
    pooling_rows: tuple[PromptRows, ...] = ()  # in row order; their sequences do not sample
    # (first row, count) of each chunk's prompt-token rows (positions < its prompt's length), chunks without
    # any left out: native/tile_rows.py
    prompt_token_spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StepLogits:
    """What a forward pass returns: logits [len(sampling), V] and the hidden states of `prompt_rows` and
    of `pooling_rows`."""

    sample: torch.Tensor
    prompt_hidden: torch.Tensor | None = None
    pooling_hidden: torch.Tensor | None = None


def narrowed(inputs: StepInputs, step: StepLogits, seq_ids: Collection[str]) -> tuple[StepInputs, StepLogits]:
    """The part of a step's inputs and of its forward pass's outputs that belongs to `seq_ids`: their
    sampling chunks with their logits rows (1 + its drafts for a speculating chunk), their prompt rows and
    pooling rows with their hidden states, in the step's order."""
    sampling, logits_rows, row = [], [], 0
    for chunk in inputs.sampling:
        count = 1 + len(chunk.draft_token_ids)
        if chunk.seq.seq_id in seq_ids:
            sampling.append(chunk)
            logits_rows.extend(range(row, row + count))
        row += count
    logits = step.sample.index_select(0, torch.tensor(logits_rows, dtype=torch.int64, device=step.sample.device))
    prompt_rows, prompt_hidden = _kept_rows(inputs.prompt_rows, step.prompt_hidden, seq_ids)
    pooling_rows, pooling_hidden = _kept_rows(inputs.pooling_rows, step.pooling_hidden, seq_ids)
    return (replace(inputs, sampling=sampling, prompt_rows=prompt_rows, pooling_rows=pooling_rows),
            StepLogits(logits, prompt_hidden, pooling_hidden))


def _kept_rows(rows: tuple[PromptRows, ...], hidden: torch.Tensor | None,
               seq_ids: Collection[str]) -> tuple[tuple[PromptRows, ...], torch.Tensor | None]:
    """The entries of `rows` (whose hidden states lie concatenated in `hidden`, in order) of `seq_ids`."""
    kept, pieces, offset = [], [], 0
    for r in rows:
        if r.seq_id in seq_ids:
            assert hidden is not None
            kept.append(r)
            pieces.append(hidden[offset : offset + r.count])
        offset += r.count
    return tuple(kept), (torch.cat(pieces) if pieces else None)
