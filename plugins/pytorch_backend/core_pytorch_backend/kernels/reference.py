"""Plain-torch versions of every hot op: the CPU path and the oracle for faster kernels.

Cache layout: ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention_metadata import AttentionMetadata

NAME = "reference"


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V ([T, Hkv, D]) into its cache slot; negative slots are skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = value.to(v_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's whole cached context.

    ``query`` is [T, Hq, D] (Hq a multiple of Hkv); the new tokens' K/V must already be in the
    cache. Single-token sequences (decode) run as one padded batch; longer chunks one by one.
    """
    out = torch.empty_like(query)
    starts = [0]
    for q_len in meta.query_lens_list:
        starts.append(starts[-1] + q_len)
    decode = [b for b, q in enumerate(meta.query_lens_list) if q == 1]
    if decode:
        rows = [starts[b] for b in decode]
        idx = torch.tensor(decode, device=query.device)
        tok = torch.tensor(rows, device=query.device)
        seq_lens = [meta.seq_lens_list[b] for b in decode]
        out[tok] = _decode_attention(
            query[tok], k_cache, v_cache, meta.block_tables[idx], seq_lens, scale, sliding_window
        )
    for b, q_len in enumerate(meta.query_lens_list):
        if q_len <= 1:
            continue
        s = starts[b]
        out[s : s + q_len] = _chunk_attention(
            query[s : s + q_len],
            k_cache,
            v_cache,
            meta.block_tables[b],
            meta.seq_lens_list[b],
            scale,
            sliding_window,
        )
    return out


def _gather_context(cache: torch.Tensor, table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[..., num_blocks * block_size, Hkv, D] context rows of one or many block tables."""
    blocks = cache[table[..., :num_blocks].long()]  # [..., nb, bs, Hkv, D]
    return blocks.flatten(-4, -3)


def _decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, window) -> torch.Tensor:
    """q [B, Hq, D], one new token per sequence, as one masked SDPA over padded contexts."""
    block_size = k_cache.shape[1]
    nb = -(-max(seq_lens) // block_size)
    k = _gather_context(k_cache, tables, nb).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_context(v_cache, tables, nb).transpose(1, 2)
    lens = torch.tensor(seq_lens, device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = j < lens
    if window is not None:
        mask &= j > (lens - 1 - window)
    out = _sdpa(q[:, :, None, :], k, v, mask[:, None, None, :], scale)  # [B, Hq, 1, D]
    return out[:, :, 0, :]


def _chunk_attention(q, k_cache, v_cache, table, seq_len, scale, window) -> torch.Tensor:
    """q [n, Hq, D]: the last n tokens of one sequence of seq_len tokens (prefill or a chunk)."""
    block_size = k_cache.shape[1]
    n = q.shape[0]
    nb = -(-seq_len // block_size)
    k = _gather_context(k_cache, table, nb)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = _gather_context(v_cache, table, nb)[:seq_len].transpose(0, 1)
    pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
    j = torch.arange(seq_len, device=q.device)[None, :]
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    out = _sdpa(q.transpose(0, 1)[None], k[None], v[None], mask[None, None], scale)  # [1, Hq, n, D]
    return out[0].transpose(0, 1)


def _sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """SDPA over [B, H, L, D] with grouped-query K/V (Hq a multiple of Hkv)."""
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32 as HF Llama; with ``residual``, returns ``(norm(x + residual), x + residual)``."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / rotate-half rotary embedding of q [T, Hq, D] and k [T, Hkv, D].

    ``cos_cache`` / ``sin_cache`` are [max_positions, D / 2] (float32); rotation uses the whole head.
    """
    cos = cos_cache[positions]
    sin = sin_cache[positions]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(query.dtype)
    q = query * cos + rotate_half(query) * sin
    k = key * cos.to(key.dtype) + rotate_half(key) * sin.to(key.dtype)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
