"""What one forward pass takes and gives: the flat batch of a step (`StepInputs`), the rows of it whose
hidden states a request keeps (`PromptRows`: to score prompt tokens, or to pool them into an embedding),
and the logits and hidden states it returns (`StepLogits`).

Shared by the model runner, which builds and runs them, and by the parts that fill or replay a step
(multimodal_inputs.py, cuda_graphs.py); it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

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
