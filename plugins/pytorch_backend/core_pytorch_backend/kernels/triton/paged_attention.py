"""The paged-attention op: the decode kernel for all-decode batches, the prefill kernel otherwise."""

from __future__ import annotations

import torch

from ...attention_metadata import AttentionMetadata
from .. import reference
from .decode_attention import decode_attention
from .prefill_attention import prefill_attention


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's whole cached context.

    ``query`` is [T, Hq, D] (Hq a multiple of Hkv); the new tokens' K/V must already be in the cache.
    An all-decode batch (one new token per sequence, the CUDA-graph case) takes the split-K decode
    kernel, which reads only tensors; any other batch takes the prefill/extend kernel. A prompt with
    bidirectional spans (Gemma 3 images, a rare prefill) takes the reference op, which implements them.
    """
    if any(getattr(meta, "bidirectional_spans", None) or ()):
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    if meta.is_decode:
        return decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                sliding_window)
    return prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                             meta.max_query_len, scale, sliding_window)
