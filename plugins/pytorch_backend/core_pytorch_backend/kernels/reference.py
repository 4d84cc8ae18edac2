"""Plain-torch versions of every hot op: the CPU path and the oracle for faster kernels.

Cache layout: ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; an int8
cache's rows are ``head_dim + kv_int8.ROW_EXTRA`` bytes (``kv_int8``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..attention_metadata import AttentionMetadata
from . import kv_int8

NAME = "reference"


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V ([T, Hkv, D]) into its cache slot; negative slots are skipped. An int8
    cache (``kv_int8``) takes the rows' codes, scales and minimums."""
    slots = k_cache.shape[0] * k_cache.shape[1]
    # One min (a host sync off the CPU) instead of a mask and .all(); a slot < 0 only comes from
    # padded rows (CUDA graphs, tests), whose rows are then dropped.
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_int8.is_int8(k_cache.dtype):
        key, value = kv_int8.quantize(key), kv_int8.quantize(value)
    k_cache.view(slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class ScoreTerms(NamedTuple):
    """What a layer adds to the plain scaled dot products before the softmax (none: SDPA as it is).

    ``softcap`` caps each score as ``softcap * tanh(score / softcap)`` (Gemma 2); ``alibi_slopes`` [Hq] adds
    ``slope * (j - i)`` for key position j and query position i (ALiBi: Bloom, MPT; transformers adds
    ``slope * j``, the same softmax); ``sinks`` [Hq] is one more logit per head in each query's softmax that
    weighs no value (gpt-oss's attention sinks). ``chunk`` masks rather than scores: a query sees only the
    keys of its own chunk of ``chunk`` positions (Llama 4's chunked attention)."""

    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    chunk: int | None = None

    @property
    def adds_scores(self) -> bool:
        return bool(self.softcap) or self.alibi_slopes is not None or self.sinks is not None

    def __bool__(self) -> bool:
        return self.adds_scores or self.chunk is not None


NO_TERMS = ScoreTerms()

def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's whole cached context, with the score terms
    (``ScoreTerms``: ``softcap``, ``alibi_slopes``, ``sinks``, ``chunk``) a layer asks for.

    ``query`` is [T, Hq, D] (Hq a multiple of Hkv); the new tokens' K/V must already be in the
    cache. Single-token sequences (decode) run as one padded batch; longer chunks one by one.
    ``meta.bidirectional_spans`` (Gemma 3 images) lets the tokens of one span also attend to the
    later tokens of that span; a one-token chunk never needs it (it is the last token of any span
    it is in, since the scheduler never ends a chunk inside a span).
    """
    terms = ScoreTerms(softcap, alibi_slopes, sinks, chunk)
    plan = _decode_plan(meta, k_cache.shape[1], query.device)
    if plan is not None and plan.rows is None:  # a pure decode step: every row is a decode row
        return _decode_attention(query, k_cache, v_cache, plan, scale, sliding_window, terms)
    out = paged_chunks(query, k_cache, v_cache, meta, scale, sliding_window, terms)
    if plan is not None:
        out[plan.rows] = _decode_attention(query[plan.rows], k_cache, v_cache, plan, scale, sliding_window, terms)
    return out


def paged_chunks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    terms: ScoreTerms = NO_TERMS,
) -> torch.Tensor:
    """``paged_attention``'s rows of the chunks (``meta.chunk_sequences``); the rows of the others
    (decode rows) are left for the caller to fill."""
    out = torch.empty_like(query)
    starts = meta.row_starts()
    spans = getattr(meta, "bidirectional_spans", None)
    for b in meta.chunk_sequences():
        s, q_len = starts[b], meta.query_lens_list[b]
        out[s : s + q_len] = _chunk_attention(
            query[s : s + q_len],
            k_cache,
            v_cache,
            meta.block_tables[b],
            meta.seq_lens_list[b],
            scale,
            sliding_window,
            spans[b] if spans else (),
            terms,
        )
    return out


def _gather_context(cache: torch.Tensor, table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_blocks * block_size, Hkv, D] context rows of one block table."""
    return _values(cache.index_select(0, table[:num_blocks].long()).flatten(0, 1))


def _values(rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a cache as values: an int8 cache's dequantized (float32), the others' as they are."""
    return kv_int8.dequantize(rows) if kv_int8.is_int8(rows.dtype) else rows


class _DecodePlan(NamedTuple):
    """What every layer's decode attention of one step shares (built once, kept in meta.op_cache)."""

    rows: torch.Tensor | None  # flat-batch rows of the decode sequences; None: all rows, in order
    blocks: torch.Tensor  # [B * nb] int64 block ids: each decode sequence's first nb blocks
    num_blocks: int  # nb: blocks of the longest decode context
    lens: torch.Tensor  # [B, 1] context length of each decode sequence
    masks: dict  # (sliding window or None, chunk or None, dtype) -> [B, 1, 1, nb * block_size] additive mask


def decode_rows(meta: AttentionMetadata, device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """The sequences with one new token (decode) and their rows in the flat batch (None: every row is
    one, in order); what every op set's decode path starts from."""
    decode = meta.decode_sequences()
    if len(decode) == len(meta.query_lens_list):
        return decode, None
    starts = meta.row_starts()
    return decode, torch.tensor([starts[b] for b in decode], device=device)


def _decode_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _DecodePlan | None:
    if "reference_decode" in meta.op_cache:
        return meta.op_cache["reference_decode"]
    decode, rows = decode_rows(meta, device)
    plan = None
    if decode:
        seq_lens = [meta.seq_lens_list[b] for b in decode]
        nb = -(-max(seq_lens) // block_size)
        tables = meta.block_tables if rows is None else meta.block_tables[torch.tensor(decode, device=device)]
        blocks = tables[:, :nb].reshape(-1).long()
        plan = _DecodePlan(rows, blocks, nb, torch.tensor(seq_lens, device=device)[:, None], {})
    meta.op_cache["reference_decode"] = plan
    return plan


def _decode_mask(plan: _DecodePlan, block_size: int, window: int | None, dtype: torch.dtype,
                 chunk: int | None = None) -> torch.Tensor:
    """[B, 1, 1, L] additive mask (0 or -inf) in the query dtype: what SDPA would turn a bool mask into
    at every call, built once per step."""
    mask = plan.masks.get((window, chunk, dtype))
    if mask is None:
        j = torch.arange(plan.num_blocks * block_size, device=plan.lens.device)[None, :]
        keep = j < plan.lens
        if window is not None:
            keep &= j > (plan.lens - 1 - window)
        if chunk is not None:
            keep &= j >= (plan.lens - 1) // chunk * chunk
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -math.inf)
        mask = plan.masks[(window, chunk, dtype)] = mask[:, None, None, :]
    return mask


def _decode_attention(q, k_cache, v_cache, plan: _DecodePlan, scale, window, terms=NO_TERMS) -> torch.Tensor:
    """q [B, Hq, D], one new token per sequence, as one masked SDPA over padded contexts."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    length = plan.num_blocks * block_size
    k = _values(k_cache.index_select(0, plan.blocks)).view(b, length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = _values(v_cache.index_select(0, plan.blocks)).view(b, length, hkv, d).transpose(1, 2)
    # Grouped-query attention without copying K/V per query head: the G query heads that share a
    # KV head become G query rows of that head.
    group = hq // hkv
    def distance() -> torch.Tensor:  # [B, 1, 1, L]: key position j - the query's position lens - 1
        return torch.arange(length, device=q.device)[None, None, None, :] - (plan.lens[:, :, None, None] - 1)

    out = _sdpa(q.view(b, hkv, group, d), k, v, _decode_mask(plan, block_size, window, q.dtype, terms.chunk), scale,
                _grouped(terms, hkv, group, 1, distance))
    return out.reshape(b, hq, d)


def _chunk_attention(q, k_cache, v_cache, table, seq_len, scale, window, spans=(), terms=NO_TERMS) -> torch.Tensor:
    """q [n, Hq, D]: the last n tokens of one sequence of seq_len tokens (prefill or a chunk).

    ``spans``: ``[start, end)`` ranges whose tokens attend to each other both ways. The sliding window
    still applies on top, as in transformers' Gemma 3: ``(causal | same span) & window``.
    """
    block_size = k_cache.shape[1]
    n, hq, d = q.shape
    nb = -(-seq_len // block_size)
    k = _gather_context(k_cache, table, nb)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = _gather_context(v_cache, table, nb)[:seq_len].transpose(0, 1)
    hkv = k.shape[0]
    group = hq // hkv
    pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    j = torch.arange(seq_len, device=q.device)[None, :]
    mask = j <= pos
    for start, end in spans:
        if end <= seq_len - n or start >= seq_len:
            continue  # no query of this chunk is in the span
        if end > seq_len:
            raise RuntimeError(f"a chunk ends at {seq_len}, inside the bidirectional span [{start}, {end}): "
                               "the scheduler must compute a span in one chunk (Sequence.atomic_spans)")
        mask |= (pos >= start) & (pos < end) & (j >= start) & (j < end)
    if window is not None:
        mask &= j > pos - window
    if terms.chunk is not None:
        mask &= j // terms.chunk == pos // terms.chunk
    # The G query heads of one KV head, stacked as G * n query rows of that head (no K/V copies).
    rows = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
    out = _sdpa(rows, k[None], v[None], mask.repeat(group, 1)[None, None], scale,
                _grouped(terms, hkv, group, n, lambda: (j - pos).repeat(group, 1)[None, None]))  # [1, Hkv, G*n, D]
    return out.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


class _Grouped(NamedTuple):
    """ScoreTerms laid out on the grouped query rows of ``_sdpa``: ``bias`` and ``sinks`` broadcast against its
    [B, Hkv, rows, L] scores."""

    softcap: float | None
    bias: torch.Tensor | None  # [B or 1, Hkv, rows, L] float32 (ALiBi)
    sinks: torch.Tensor | None  # [1, Hkv, rows, 1]


def _grouped(terms: ScoreTerms, hkv: int, group: int, n: int,
             distance: Callable[[], torch.Tensor]) -> _Grouped | None:
    """``terms`` for query rows that stack the ``group`` query heads of each KV head, ``n`` rows per head
    (head-major); ``distance()`` [B or 1, 1, group * n or 1, L] is each row's j - i (ALiBi's only)."""
    if not terms.adds_scores:
        return None

    def per_row(values: torch.Tensor) -> torch.Tensor:  # [Hq] -> [1, Hkv, group * n, 1]
        return values.float().view(hkv, group, 1).expand(hkv, group, n).reshape(1, hkv, group * n, 1)

    bias = None if terms.alibi_slopes is None else per_row(terms.alibi_slopes) * distance()
    sinks = None if terms.sinks is None else per_row(terms.sinks)
    return _Grouped(terms.softcap, bias, sinks)


def _sdpa(q, k, v, mask, scale, terms: _Grouped | None = None) -> torch.Tensor:
    """SDPA over [B, H, Lq, D] queries and [B, H, L, D] keys/values (same number of heads); with score terms
    written out as transformers' eager attention computes them (SDPA has no score hook): Gemma 2's softcap,
    ALiBi's bias, gpt-oss's sinks (one more logit in the softmax, dropped after it)."""
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if terms is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if terms.softcap:
        scores = torch.tanh(scores / terms.softcap) * terms.softcap
    if terms.bias is not None:
        scores = scores + terms.bias
    scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    if terms.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    sinks = terms.sinks.expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32 as HF Llama; with ``residual``, returns ``(norm(x + residual), x + residual)``.

    ``torch.rms_norm`` runs HF's float32 formula (square, mean, + eps, rsqrt, multiply) as one op, bit
    for bit. HF rounds the normalised rows to the input dtype before the weight multiplies them, so
    the weight joins the fused op only in float32."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = torch.rms_norm(x, x.shape[-1:], weight, eps)
    else:
        out = weight * torch.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
    return out if residual is None else (out, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's layer_norm with ``rms_norm``'s residual protocol (``layers.norm.LayerNorm``'s)."""
    if residual is not None:
        x = x + residual
        residual = x
    out = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return out if residual is None else (out, residual)


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / rotate-half rotary embedding of q [T, Hq, D] and k [T, Hkv, D].

    ``cos_cache`` / ``sin_cache`` are [max_positions, D / 2] (float32); rotation uses the whole head.
    ``x * cos + rotate_half(x) * sin`` is computed as ``x * cos + roll(x, D / 2) * [-sin, sin]``: the
    same products, bit for bit, in fewer ops.
    """
    cos, signed_sin = _rotary_rows(positions, cos_cache, sin_cache, query.dtype)
    half, heads = query.shape[-1] // 2, query.shape[1]
    if key.dtype == query.dtype:  # q and k rotate as one [T, Hq + Hkv, D] tensor: half the ops
        both = torch.cat((query, key), dim=1)
        both = both * cos + torch.roll(both, half, -1) * signed_sin
        return both[:, :heads], both[:, heads:]
    q = query * cos + torch.roll(query, half, -1) * signed_sin
    k = key * cos.to(key.dtype) + torch.roll(key, half, -1) * signed_sin.to(key.dtype)
    return q, k


class _RotaryRows(NamedTuple):
    """The cos/sin rows of one step's positions; every layer of the step asks for the same ones."""

    positions: torch.Tensor  # a copy of the positions they were built for
    tables: tuple[torch.Tensor, torch.Tensor]  # cos_cache, sin_cache
    dtype: torch.dtype
    cos: torch.Tensor  # [T, 1, D]: [cos, cos]
    signed_sin: torch.Tensor  # [T, 1, D]: [-sin, sin]


_last_rotary_rows: _RotaryRows | None = None


def _rotary_rows(positions, cos_cache, sin_cache, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered, widened and cast cos/sin rows of ``positions``. On the CPU they are built once
    per step rather than once per layer: equal positions and the same tables give the same rows
    (compared by value, so a positions buffer reused in place is still safe)."""
    global _last_rotary_rows
    last = _last_rotary_rows
    if (positions.is_cpu and last is not None and last.dtype == dtype and last.tables[0] is cos_cache
            and last.tables[1] is sin_cache and torch.equal(last.positions, positions)):
        return last.cos, last.signed_sin
    cos, sin = cos_cache[positions], sin_cache[positions]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype)
    signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)
    if positions.is_cpu:
        _last_rotary_rows = _RotaryRows(positions.clone(), (cos_cache, sin_cache), dtype, cos, signed_sin)
    return cos, signed_sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up] along the last dimension (Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
