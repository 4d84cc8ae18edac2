"""The sampler's input: per-request parameters, one row per logits row, and the step's batch as tensors.

The engine loop turns each request's resolved GenerationConfig into `SamplingParams` once
(`SamplingParams.from_config`), hands one `SamplingRow` per row of the step's logits, and
`SamplingBatch.from_rows` packs them into the tensors `sampling.sample` reads. Fields no row uses stay
None, so the sampler skips their work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (same attribute names as the core's GenerationConfig).

    ``temperature == 0`` means greedy; ``top_k`` 0 or -1, ``top_p`` 1.0, ``min_p`` 0,
    ``repetition_penalty`` 1.0 and zero presence/frequency penalties mean "off". ``logprobs`` is None
    (no logprobs) or k in 0..20 (the sampled token's logprob plus the top k).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, config: Any) -> SamplingParams:
        """The one conversion from a request's resolved GenerationConfig (or any object carrying some
        of these attribute names). A missing attribute or None takes the field's default, its "off"
        value; GenerationConfig's ``logprobs`` flag with ``top_logprobs`` becomes ``logprobs`` k."""
        if isinstance(config, SamplingParams):
            return config
        defaults = cls()
        values = {}
        for name in cls.__dataclass_fields__:
            value = getattr(config, name, None)
            values[name] = getattr(defaults, name) if value is None else value
        if isinstance(values["logprobs"], bool):  # GenerationConfig: a flag, and k in top_logprobs
            values["logprobs"] = getattr(config, "top_logprobs", 0) if values["logprobs"] else None
        values["logit_bias"] = dict(values["logit_bias"] or {}) or None
        values["allowed_token_ids"] = tuple(values["allowed_token_ids"] or ()) or None
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator. The engine keeps it for the request's lifetime and passes it
    in the request's :class:`SamplingRow` every step; the sampler advances it once per sampled step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingRow:
    """One row of the step's logits: the request's params, its tokens so far and its generator.

    ``params`` may be a :class:`SamplingParams` or any object with the same attribute names.
    ``banned_token_ids`` are never sampled this step (the engine passes stop/eos ids here while
    ``min_new_tokens`` is not reached). ``generator`` is required when ``params.seed`` is set.
    ``constraint`` is the row's structured-output matcher (core.structured_output.ConstraintMatcher):
    only the tokens it allows are sampled.
    """

    params: Any
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()
    constraint: Any = None


@dataclass(frozen=True)
class _FlatTokens:
    """Token ids of several rows, flattened: ``rows[j]`` owns ``ids[j]``; ``max_id`` for bounds checks."""

    rows: torch.Tensor
    ids: torch.Tensor
    max_id: int

    def counts(self, batch_size: int, vocab_size: int) -> torch.Tensor:
        """``[B, V]`` occurrence counts, one bincount over ``row * (V + 1) + id``.

        Ids >= V (an embedding vocab larger than the lm head) land in a spare column that is dropped:
        the model cannot produce them, so there is nothing to penalise."""
        width = vocab_size + 1
        keys = self.rows * width + self.ids.clamp(max=vocab_size)
        counts = torch.bincount(keys, minlength=batch_size * width)
        return counts.view(batch_size, width)[:, :vocab_size]


@dataclass(frozen=True)
class _IndexedValues:
    """Sparse per-row ``(row, token id) -> value`` entries (logit bias, banned tokens)."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor
    max_id: int


def _flatten_tokens(per_row: Sequence[Sequence[int]], device: torch.device) -> _FlatTokens | None:
    """Concatenate per-row token ids into one flat tensor plus their row indices (None if all empty)."""
    chunks = [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in per_row]
    lengths = torch.tensor([c.numel() for c in chunks], dtype=torch.long)
    if int(lengths.sum()) == 0:
        return None
    ids = torch.cat(chunks)
    if int(ids.min()) < 0:
        raise ValueError("sampling: token ids must be non-negative")
    rows = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
    return _FlatTokens(rows.to(device), ids.to(device), int(ids.max()))


def _indexed_values(entries: list[tuple[int, int, float]], device: torch.device) -> _IndexedValues | None:
    """Pack ``(row, token id, value)`` triples into tensors (None if there are none)."""
    if not entries:
        return None
    rows, ids, values = zip(*entries, strict=True)
    if min(ids) < 0:
        raise ValueError("sampling: token ids in logit_bias / banned_token_ids must be non-negative")
    return _IndexedValues(
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
        max(ids),
    )


def _float_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class SamplingBatch:
    """Everything :func:`sample` needs for one step, as tensors; build it with :meth:`from_rows`.

    Fields that no row uses are None so that :func:`sample` skips their work entirely. Tensors
    named ``sample_*`` are indexed by position in ``sample_rows`` (the non-greedy rows).
    """

    size: int
    device: torch.device
    params: tuple[SamplingParams, ...]
    # Non-greedy rows: indices, temperatures, truncation params and generators.
    sample_rows: list[int]
    sample_index: torch.Tensor | None
    sample_temperature: torch.Tensor | None
    sample_top_k: torch.Tensor | None
    sample_one_minus_top_p: torch.Tensor | None
    sample_min_p: torch.Tensor | None
    sample_generators: tuple[torch.Generator | None, ...]
    # Logits processors over all rows.
    repetition_penalty: torch.Tensor | None
    repetition_tokens: _FlatTokens | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    output_tokens: _FlatTokens | None
    logit_bias: _IndexedValues | None
    banned: _IndexedValues | None
    # Rows asking for logprobs, and how many top entries each wants.
    logprob_rows: list[int]
    logprob_k: list[int]
    # Structured output: (row, matcher) of each constrained row.
    constrained: tuple[tuple[int, Any], ...] = ()
    # (row, the only token ids it may sample) of each row with allowed_token_ids.
    allowed: tuple[tuple[int, torch.Tensor], ...] = ()

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], device: torch.device | str = "cpu") -> SamplingBatch:
        """Build the step's batch; ``rows[i]`` describes row i of the logits passed to :func:`sample`."""
        device = torch.device(device)
        params = tuple(SamplingParams.from_config(row.params) for row in rows)
        for i, (row, p) in enumerate(zip(rows, params, strict=True)):
            if p.seed is not None and row.generator is None and not p.greedy:
                raise ValueError(f"sampling: row {i} is seeded but has no generator (use make_generator)")
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            size=len(rows),
            device=device,
            params=params,
            **_sampled_fields(rows, params, device),
            **_penalty_fields(rows, params, device),
            **_sparse_fields(rows, params, device),
            logprob_rows=logprob_rows,
            logprob_k=[params[i].logprobs or 0 for i in logprob_rows],
            constrained=tuple((i, row.constraint) for i, row in enumerate(rows) if row.constraint is not None),
            allowed=tuple((i, torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device))
                          for i, p in enumerate(params) if p.allowed_token_ids),
        )

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor (penalty, bias, ban, allowed tokens) is active in this batch."""
        return bool(self.constrained or self.allowed) or any(
            x is not None for x in (self.repetition_tokens, self.output_tokens, self.logit_bias, self.banned)
        )


def _sampled_fields(
    rows: Sequence[SamplingRow], params: tuple[SamplingParams, ...], device: torch.device
) -> dict[str, Any]:
    """Fields of the non-greedy rows; truncation tensors are None when no sampled row truncates."""
    idx = [i for i, p in enumerate(params) if not p.greedy]
    sampled = [params[i] for i in idx]
    top_k = [p.top_k if p.uses_top_k else 0 for p in sampled]
    # 1 - top_p is computed in double precision as HF does (it compares cumsum with a Python float).
    one_minus_top_p = [1.0 - p.top_p for p in sampled]
    min_p = [p.min_p for p in sampled]
    return {
        "sample_rows": idx,
        "sample_index": torch.tensor(idx, dtype=torch.long, device=device) if idx else None,
        "sample_temperature": _float_tensor([p.temperature for p in sampled], device) if idx else None,
        "sample_top_k": (torch.tensor(top_k, dtype=torch.long, device=device) if any(top_k) else None),
        "sample_one_minus_top_p": (
            _float_tensor(one_minus_top_p, device) if any(p.uses_top_p for p in sampled) else None
        ),
        "sample_min_p": _float_tensor(min_p, device) if any(m > 0 for m in min_p) else None,
        "sample_generators": tuple(rows[i].generator for i in idx),
    }


def _penalty_fields(
    rows: Sequence[SamplingRow], params: tuple[SamplingParams, ...], device: torch.device
) -> dict[str, Any]:
    """Penalty tensors; token lists are only flattened for rows that use the penalty."""
    fields: dict[str, Any] = dict.fromkeys(
        ("repetition_penalty", "repetition_tokens", "presence_penalty", "frequency_penalty", "output_tokens")
    )
    if any(p.uses_repetition_penalty for p in params):
        seen = [
            [*row.prompt_token_ids, *row.output_token_ids] if p.uses_repetition_penalty else ()
            for row, p in zip(rows, params, strict=True)
        ]
        fields["repetition_tokens"] = _flatten_tokens(seen, device)
        fields["repetition_penalty"] = _float_tensor([p.repetition_penalty for p in params], device)
    if any(p.uses_output_penalties for p in params):
        outputs = [
            row.output_token_ids if p.uses_output_penalties else ()
            for row, p in zip(rows, params, strict=True)
        ]
        fields["output_tokens"] = _flatten_tokens(outputs, device)
        fields["presence_penalty"] = _float_tensor([p.presence_penalty for p in params], device)
        fields["frequency_penalty"] = _float_tensor([p.frequency_penalty for p in params], device)
    return fields


def _sparse_fields(
    rows: Sequence[SamplingRow], params: tuple[SamplingParams, ...], device: torch.device
) -> dict[str, Any]:
    """Logit bias and banned tokens as sparse (row, id, value) tensors."""
    bias = [
        (i, int(token), float(value))
        for i, p in enumerate(params)
        for token, value in (p.logit_bias or {}).items()
    ]
    banned = [(i, int(token), -math.inf) for i, row in enumerate(rows) for token in row.banned_token_ids]
    return {"logit_bias": _indexed_values(bias, device), "banned": _indexed_values(banned, device)}
