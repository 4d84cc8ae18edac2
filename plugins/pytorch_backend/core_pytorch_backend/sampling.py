"""Batched token sampler for the pytorch backend.

Each engine step hands the sampler float32 logits ``[B, V]`` (one row per sequence that samples this
step) and a :class:`SamplingBatch` describing every row. :func:`sample` picks one token per row with
per-row parameters, all rows at once:

1. logits processors: repetition penalty (HF semantics), presence/frequency penalties (OpenAI
   semantics), logit bias, banned tokens;
2. greedy rows (temperature 0) take the argmax of the processed logits;
3. sampled rows are divided by their temperature, truncated by top-k/top-p (one shared sort) and
   min-p, then sampled with the exponential race (``argmax(logits - log(q))``, ``q ~ Exp(1)``),
   which is exact sampling from ``softmax`` of the truncated logits.

Every seeded row draws its noise from its own ``torch.Generator`` only, so a seeded request yields
the same tokens whatever batch it lands in. Logprobs are taken from the raw logits (before any
processing), as the OpenAI API reports them.

The core validates user-facing parameters; the checks here only guard internal invariants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "MAX_LOGPROBS",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprobs",
    "apply_logits_processors",
    "apply_truncation",
    "make_generator",
    "sample",
]

MAX_LOGPROBS = 20


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

    @classmethod
    def from_config(cls, config: Any) -> SamplingParams:
        """Build from any object carrying (a subset of) these attribute names, e.g. GenerationConfig."""
        if isinstance(config, SamplingParams):
            return config
        defaults = cls()
        values = {}
        for name in cls.__dataclass_fields__:
            # A missing attribute or None means "off" (every field's default is its "off" value).
            value = getattr(config, name, None)
            values[name] = getattr(defaults, name) if value is None else value
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
    """

    params: Any
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()


class TokenLogprobs(NamedTuple):
    """Logprobs of one row, from the raw logits: the sampled token, its logprob, the top k descending."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class SamplerOutput:
    """``token_ids[i]`` is row i's token; ``logprobs[i]`` is None unless row i asked for logprobs.
    ``token_ids_tensor`` is the same tokens on the logits' device (to feed the next step directly)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    token_ids_tensor: torch.Tensor


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
        )

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor (penalty, bias, ban) is active in this batch."""
        return any(
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


# --------------------------------------------------------------------------------------------------
# Logits processing
# --------------------------------------------------------------------------------------------------


def _check_vocab(max_id: int, vocab_size: int, what: str) -> None:
    if max_id >= vocab_size:
        raise ValueError(f"sampling: {what} token id {max_id} is outside the vocabulary (size {vocab_size})")


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit bias and banned tokens for all rows. Never modifies ``logits`` in place
    (the raw logits are still needed for logprobs); returns ``logits`` itself when nothing applies."""
    batch_size, vocab_size = logits.shape
    out = logits
    if batch.repetition_tokens is not None and batch.repetition_penalty is not None:
        seen = batch.repetition_tokens.counts(batch_size, vocab_size) > 0
        penalty = batch.repetition_penalty[:, None]
        out = torch.where(seen, torch.where(out < 0, out * penalty, out / penalty), out)
    if batch.output_tokens is not None:
        counts = batch.output_tokens.counts(batch_size, vocab_size).to(out.dtype)
        assert batch.frequency_penalty is not None and batch.presence_penalty is not None
        out = out - batch.frequency_penalty[:, None] * counts
        out = out - batch.presence_penalty[:, None] * (counts > 0).to(out.dtype)
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        _check_vocab(bias.max_id, vocab_size, "logit_bias")
        out = out.index_put((bias.rows, bias.ids), bias.values.to(out.dtype), accumulate=True)
    if batch.banned is not None:
        banned = batch.banned
        _check_vocab(banned.max_id, vocab_size, "banned")
        out = out.index_put((banned.rows, banned.ids), banned.values.to(out.dtype))
    return out


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, one_minus_top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p (on the top-k renormalised distribution, as HF chains them) with ONE sort.

    Ascending order, like HF's TopPLogitsWarper: removing tokens whose ascending cumulative mass is
    <= 1 - p keeps the smallest set of top tokens whose mass is >= p; the top token always stays.
    Top-k keeps ties with the k-th logit (as HF's TopKLogitsWarper does); k = 0 or k > V keeps all."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        kth = sorted_logits.gather(-1, (vocab_size - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    if one_minus_top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= one_minus_top_p[:, None]
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, -math.inf)
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without top-p: a partial ``topk`` up to the largest k finds each row's k-th logit, much
    cheaper than a full vocab sort when k is small. Same tie semantics as :func:`_apply_top_k_top_p`."""
    vocab_size = logits.shape[-1]
    k = top_k.clamp(max=vocab_size)
    k_max = max(int(k.max()), 1)
    kth = logits.topk(k_max, dim=-1).values.gather(-1, (k.clamp(min=1) - 1)[:, None])
    kth = kth.masked_fill((k <= 0)[:, None], -math.inf)  # top-k off for this row: keep everything
    return logits.masked_fill(logits < kth, -math.inf)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top probability (HF's MinPLogitsWarper).
    The top token always survives (its ratio is 1 >= min_p)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -math.inf)


def apply_truncation(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    one_minus_top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask (to -inf) the tokens removed by per-row top-k, top-p and min-p, in HF's order.

    ``top_k`` is ``[n]`` long (0 = off), ``one_minus_top_p`` is ``[n]`` float (0 = off) and ``min_p``
    is ``[n]`` float (0 = off); None skips that truncation for every row."""
    if one_minus_top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, one_minus_top_p)
    elif top_k is not None:
        logits = _apply_top_k_only(logits, top_k)
    if min_p is not None:
        logits = _apply_min_p(logits, min_p)
    return logits


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------


def _exponential_noise(
    shape: torch.Size, generators: tuple[torch.Generator | None, ...], device: torch.device
) -> torch.Tensor:
    """``q ~ Exp(1)`` per row: each seeded row from its own generator (so its draw does not depend on
    the batch around it), the unseeded rows together from the global generator."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return noise.exponential_()
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        fresh = torch.empty((len(unseeded), shape[-1]), dtype=torch.float32, device=device).exponential_()
        noise[torch.tensor(unseeded, device=device)] = fresh
    for i, generator in seeded:
        if generator.device.type != device.type:
            raise ValueError(f"sampling: generator on {generator.device}, logits on {device}")
        noise[i].exponential_(generator=generator)
    return noise


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    one_minus_top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    noise: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``logits`` [n, V] (temperature > 0): the exponential race over the top-k /
    top-p / min-p survivors with the given Exp(1) ``noise`` [n, V]. The plain-torch version of an op
    set's fused ``sample_tokens`` kernel (same signature), and its oracle.

    ``argmax(p / q)`` with ``q ~ Exp(1)`` is an exact draw from ``p``; in log space it is
    ``argmax(logits - log q)``, which needs no softmax and leaves -inf (masked) tokens out."""
    scaled = logits / temperature[:, None]
    scaled = apply_truncation(scaled, top_k, one_minus_top_p, min_p)
    # Exp(1) can return exactly 0 in float32; clamping keeps log(q) finite so -inf stays -inf.
    log_noise = noise.clamp(min=torch.finfo(torch.float32).tiny).log_()
    return (scaled - log_noise).argmax(dim=-1)


SampleKernel = Callable[..., torch.Tensor]  # sample_tokens' signature


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None) -> torch.Tensor:
    """Sample the non-greedy rows (``logits`` holds exactly those rows, in ``sample_rows`` order).

    The noise is drawn here for every op set (seeded rows from their own generators), so a fused
    kernel gives the same draws as the plain-torch path."""
    assert batch.sample_temperature is not None
    noise = _exponential_noise(logits.shape, batch.sample_generators, logits.device)
    return (kernel or sample_tokens)(logits.float(), batch.sample_temperature, batch.sample_top_k,
                                     batch.sample_one_minus_top_p, batch.sample_min_p, noise)


def _choose_tokens(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None) -> torch.Tensor:
    """Token per row from processed logits: argmax for greedy rows, a draw for the others."""
    if batch.sample_index is None:
        return logits.argmax(dim=-1)
    if len(batch.sample_rows) == batch.size:
        return _sample_rows(logits, batch, kernel)
    tokens = logits.argmax(dim=-1)
    sampled = _sample_rows(logits.index_select(0, batch.sample_index), batch, kernel)
    return tokens.index_copy_(0, batch.sample_index, sampled)


def _compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    """Logprobs from the RAW logits for the rows that asked: sampled token plus top k, descending."""
    result: list[TokenLogprobs | None] = [None] * batch.size
    if not batch.logprob_rows:
        return result
    index = torch.tensor(batch.logprob_rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.index_select(0, index)[:, None]).squeeze(-1).tolist()
    k_max = min(max(batch.logprob_k), logprobs.shape[-1])
    values: list[list[float]] = [[] for _ in index]
    ids: list[list[int]] = [[] for _ in index]
    if k_max > 0:
        top = logprobs.topk(k_max, dim=-1)  # sorted descending
        values, ids = top.values.tolist(), top.indices.tolist()
    for j, (row, k) in enumerate(zip(batch.logprob_rows, batch.logprob_k, strict=True)):
        pairs = list(zip(ids[j][:k], values[j][:k], strict=True))
        result[row] = TokenLogprobs(token_ids[row], chosen[j], pairs)
    return result


def _check_inputs(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sampling: logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] != batch.size:
        raise ValueError(f"sampling: logits have {logits.shape[0]} rows but the batch has {batch.size}")
    if not logits.is_floating_point():
        raise ValueError(f"sampling: logits must be floating point, got {logits.dtype}")
    if logits.device.type != batch.device.type:
        raise ValueError(f"sampling: logits on {logits.device}, batch built for {batch.device}")


@torch.no_grad()
def sample(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` with the per-row parameters of ``batch``.

    ``kernel`` is an op set's fused ``sample_tokens`` (None: the plain-torch one). ``logits`` is not
    modified. An all-greedy batch without processors costs a single argmax."""
    _check_inputs(logits, batch)
    # Returns ``logits`` itself (no copy) when no row uses penalties, bias or banned tokens.
    processed = apply_logits_processors(logits, batch)
    tokens = _choose_tokens(processed, batch, kernel)
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _compute_logprobs(logits, tokens, token_ids, batch), tokens)
