"""Images in the pytorch backend: each sequence's image embeddings and positions, and what one step's
chunks take from them.

A request's `MultiModalInputs` (from the vision processor, with its embeddings) becomes a
`SequenceImages` on the sequence (``Sequence.multimodal``), so preemption (recompute) and n > 1 forks
keep it. Each step then picks, for every scheduled chunk ``[start, start + n)``:

- the embedding rows whose prompt positions fall inside the chunk (chunked prefill may split an image
  across steps, or a prefix-cache hit may start a chunk inside one), as ``embed_overrides``;
- M-RoPE positions: the processor's 3D positions inside the prompt, ``index + delta`` after it;
- the image spans a bidirectional-image model (Gemma 3) lets attend to each other.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.scheduling import ScheduledSequence
from core_pytorch_backend.step_inputs import StepInputs

Span = tuple[int, int]


@dataclass(frozen=True)
class SequenceImages:
    """One request's images, ready for the model.

    :param positions: sorted prompt positions that receive embedding rows ([K], on the CPU).
    :param embeds: the rows, [K, hidden], on the model's device and in its dtype.
    :param mrope_positions: [3, prompt_len] M-RoPE positions, or None (1D positions).
    :param mrope_delta: decode position = sequence index + delta on all three axes.
    :param spans: each image's placeholder range as ``[start, end)``.
    :param bidirectional: image tokens of one image attend to each other (Gemma 3).
    """

    positions: torch.Tensor
    position_list: tuple[int, ...]
    embeds: torch.Tensor
    mrope_positions: torch.Tensor | None
    mrope_delta: int
    spans: tuple[Span, ...]
    bidirectional: bool

    @classmethod
    def from_inputs(cls, inputs: Any, hidden_size: int, device: torch.device, dtype: torch.dtype,
                    uses_mrope: bool) -> SequenceImages:
        """Check a request's `MultiModalInputs` against the model; ValueError names what is wrong."""
        embeds = list(inputs.image_embeds or ())
        if len(embeds) != len(inputs.placeholder_ranges):
            raise ValueError(f"{len(inputs.placeholder_ranges)} image(s) but {len(embeds)} embedding tensor(s)")
        positions: list[int] = []
        for i, rows in enumerate(embeds):
            wanted = inputs.embedding_positions(i)
            if rows.dim() != 2 or rows.shape[0] != len(wanted) or rows.shape[1] != hidden_size:
                raise ValueError(f"image {i}: embeddings of shape {tuple(rows.shape)}, the model needs "
                                 f"({len(wanted)}, {hidden_size})")
            positions.extend(wanted)
        if uses_mrope != (inputs.mrope_positions is not None):
            raise ValueError("the request's position information does not fit this model (M-RoPE "
                             f"{'needed' if uses_mrope else 'not supported'})")
        flat = torch.cat(embeds) if embeds else torch.empty((0, hidden_size))
        mrope = inputs.mrope_positions
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64), position_list=tuple(positions),
            embeds=flat.to(device=device, dtype=dtype),
            mrope_positions=None if mrope is None else torch.as_tensor(mrope, dtype=torch.int64).cpu(),
            mrope_delta=int(inputs.mrope_position_delta or 0),
            spans=tuple((r.start, r.start + r.length) for r in inputs.placeholder_ranges),
            bidirectional=bool(inputs.bidirectional_image_attention),
        )

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """Index range of the embedding rows whose positions fall in ``[start, end)``."""
        return bisect.bisect_left(self.position_list, start), bisect.bisect_left(self.position_list, end)

    def mrope_chunk(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of sequence indices ``[start, end)``."""
        prompt_len = 0 if self.mrope_positions is None else self.mrope_positions.shape[1]
        parts = []
        if start < prompt_len:
            parts.append(self.mrope_positions[:, start:min(end, prompt_len)])
        if end > prompt_len:
            tail = torch.arange(max(start, prompt_len), end, dtype=torch.int64) + self.mrope_delta
            parts.append(tail.expand(3, -1))
        return torch.cat(parts, dim=1)


def cache_keys(inputs: Any) -> list[tuple[int, int, str]]:
    """Prefix-cache keys: each image's content hash over its placeholder span."""
    return [(r.start, r.start + r.length, h) for r, h in zip(inputs.placeholder_ranges, inputs.image_hashes,
                                                               strict=True)]


def embed_overrides(scheduled: Sequence[ScheduledSequence],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows of the flat batch, embeddings) of the image tokens this step computes; None if none."""
    rows, values, offset = [], [], 0
    for s in scheduled:
        images: SequenceImages | None = s.seq.multimodal
        if images is not None:
            lo, hi = images.rows_in(s.start, s.start + s.num_new_tokens)
            if hi > lo:
                rows.append(images.positions[lo:hi] - s.start + offset)
                values.append(images.embeds[lo:hi])
        offset += s.num_new_tokens
    if not rows:
        return None
    return torch.cat(rows).to(device), torch.cat(values)


def mrope_positions(scheduled: Sequence[ScheduledSequence], device: torch.device) -> torch.Tensor | None:
    """[3, T] M-RoPE positions of the step, or None when no chunk has 3D positions (text only: the
    1D positions are then exact)."""
    if not any(getattr(s.seq.multimodal, "mrope_positions", None) is not None for s in scheduled):
        return None
    parts = []
    for s in scheduled:
        end = s.start + s.num_new_tokens
        images: SequenceImages | None = s.seq.multimodal
        if images is not None and images.mrope_positions is not None:
            parts.append(images.mrope_chunk(s.start, end))
        else:
            parts.append(torch.arange(s.start, end, dtype=torch.int64).expand(3, -1))
    return torch.cat(parts, dim=1).to(device)


def bidirectional_spans(scheduled: Sequence[ScheduledSequence]) -> list[tuple[Span, ...]] | None:
    """Per scheduled sequence, the image spans whose tokens attend to each other; None if no chunk
    of this step has any."""
    spans = [images.spans if (images := s.seq.multimodal) is not None and images.bidirectional else ()
             for s in scheduled]
    return spans if any(spans) else None


def with_images(inputs: StepInputs, scheduled: Sequence[ScheduledSequence], device: torch.device) -> StepInputs:
    """`inputs` of a step in which some sequence has images: embeddings, positions, attention spans."""
    positions = mrope_positions(scheduled, device)
    inputs.meta.bidirectional_spans = bidirectional_spans(scheduled)
    return dataclasses.replace(inputs, positions=inputs.positions if positions is None else positions,
                               embed_overrides=embed_overrides(scheduled, device))
