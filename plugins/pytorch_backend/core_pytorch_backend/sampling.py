"""Batched token sampler for the pytorch backend.

Each engine step hands the sampler float32 logits ``[B, V]`` (one row per sequence that samples this
step) and a :class:`SamplingBatch` describing every row (built in sampling_batch.py, whose names are
re-exported here as the sampler's interface). :func:`sample` picks one token per row with
per-row parameters, all rows at once:

1. logits processors: repetition penalty (HF semantics), presence/frequency penalties (OpenAI
   semantics), logit bias, banned tokens, allowed tokens (vLLM's allowed_token_ids), then the
   structured-output mask of constrained rows (each
   row's matcher fills its row of one packed bitmask; tokens it does not allow become -inf);
2. greedy rows (temperature 0) take the argmax of the processed logits;
3. sampled rows are divided by their temperature, truncated by top-k/top-p (one shared sort) and
   min-p, then sampled with the exponential race (``argmax(logits - log(q))``, ``q ~ Exp(1)``),
   which is exact sampling from ``softmax`` of the truncated logits.

Every seeded row draws its noise from its own ``torch.Generator`` only, so a seeded request yields
the same tokens whatever batch it lands in. Logprobs are taken from the raw logits (before any
processing and before any constraint: the model's own distribution), as the OpenAI API reports them, as
the core's `TokenLogprob`.

The core validates user-facing parameters; the checks here only guard internal invariants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.backend import TokenLogprob
from core_pytorch_backend.sampling_batch import SamplingBatch, SamplingParams, SamplingRow, make_generator

__all__ = [
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "apply_constraints",
    "apply_logits_processors",
    "apply_truncation",
    "make_generator",
    "sample",
    "sample_tokens",
]


@dataclass(frozen=True)
class SamplerOutput:
    """``token_ids[i]`` is row i's token; ``logprobs[i]`` is None unless row i asked for logprobs.
    ``token_ids_tensor`` is the same tokens on the logits' device (to feed the next step directly)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    token_ids_tensor: torch.Tensor


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
    if batch.allowed:
        out = _keep_allowed(out, batch.allowed)
    return out


def _keep_allowed(logits: torch.Tensor, allowed: tuple[tuple[int, torch.Tensor], ...]) -> torch.Tensor:
    """-inf for every token outside each listed row's allowed ids (vLLM's allowed_token_ids)."""
    vocab_size = logits.shape[-1]
    keep = torch.zeros((len(allowed), vocab_size), dtype=torch.bool, device=logits.device)
    for j, (_, ids) in enumerate(allowed):
        _check_vocab(int(ids.max()), vocab_size, "allowed_token_ids")
        keep[j, ids] = True
    index = torch.tensor([row for row, _ in allowed], dtype=torch.long, device=logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~keep, -math.inf))


def apply_constraints(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """-inf for the tokens each constrained row's matcher does not allow; ``logits`` itself when no row
    is constrained (never modified in place). The matchers fill one int32 bitmask ``[rows, ceil(V/32)]``
    (bit j of word i: token 32 i + j), unpacked here into a boolean mask."""
    if not batch.constrained:
        return logits
    vocab_size = logits.shape[-1]
    bitmask = torch.zeros((len(batch.constrained), (vocab_size + 31) // 32), dtype=torch.int32)
    for j, (_, matcher) in enumerate(batch.constrained):
        matcher.fill_bitmask(bitmask, j)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(batch.constrained), -1)[:, :vocab_size].bool().to(logits.device)
    index = torch.tensor([row for row, _ in batch.constrained], dtype=torch.long, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, -math.inf)
    return logits.index_copy(0, index, masked)


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
ArgmaxKernel = Callable[[torch.Tensor], torch.Tensor]  # an op set's argmax_rows: [B, V] -> [B] int64


def _argmax(logits: torch.Tensor, argmax: ArgmaxKernel | None) -> torch.Tensor:
    return argmax(logits) if argmax is not None else logits.argmax(dim=-1)


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None) -> torch.Tensor:
    """Sample the non-greedy rows (``logits`` holds exactly those rows, in ``sample_rows`` order).

    The noise is drawn here for every op set (seeded rows from their own generators), so a fused
    kernel gives the same draws as the plain-torch path."""
    assert batch.sample_temperature is not None
    noise = _exponential_noise(logits.shape, batch.sample_generators, logits.device)
    return (kernel or sample_tokens)(logits.float(), batch.sample_temperature, batch.sample_top_k,
                                     batch.sample_one_minus_top_p, batch.sample_min_p, noise)


def _choose_tokens(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None,
                   argmax: ArgmaxKernel | None) -> torch.Tensor:
    """Token per row from processed logits: argmax for greedy rows, a draw for the others."""
    if batch.sample_index is None:
        return _argmax(logits, argmax)
    if len(batch.sample_rows) == batch.size:
        return _sample_rows(logits, batch, kernel)
    tokens = _argmax(logits, argmax)
    sampled = _sample_rows(logits.index_select(0, batch.sample_index), batch, kernel)
    return tokens.index_copy_(0, batch.sample_index, sampled)


def _compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], batch: SamplingBatch
) -> list[TokenLogprob | None]:
    """Logprobs from the RAW logits for the rows that asked: sampled token plus top k, descending."""
    result: list[TokenLogprob | None] = [None] * batch.size
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
        pairs = tuple(zip(ids[j][:k], values[j][:k], strict=True))
        result[row] = TokenLogprob(token_ids[row], chosen[j], pairs)
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
def sample(logits: torch.Tensor, batch: SamplingBatch, kernel: SampleKernel | None = None,
           argmax: ArgmaxKernel | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[B, V]`` with the per-row parameters of ``batch``.

    ``kernel`` is an op set's fused ``sample_tokens`` and ``argmax`` its ``argmax_rows`` (None: the
    plain-torch ones). ``logits`` is not modified. An all-greedy batch without processors costs a
    single argmax."""
    _check_inputs(logits, batch)
    # Returns ``logits`` itself (no copy) when no row uses penalties, bias or banned tokens.
    processed = apply_constraints(apply_logits_processors(logits, batch), batch)
    tokens = _choose_tokens(processed, batch, kernel, argmax)
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _compute_logprobs(logits, tokens, token_ids, batch), tokens)
