"""Shared cases for checking an op set against ``kernels.reference`` (the Triton set here, the cuda
backend's own set there): random inputs, closeness with a stated tolerance, and paged-attention problems
with their contexts in shuffled cache blocks. Like ``core.testing``, it ships so that another backend's
tests can run the same cases.
"""

from __future__ import annotations

import random

import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import reference

#: (query heads, KV heads) per grouped-query ratio
GQA = {"gqa1": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1)}
#: paged-attention batches as [(cached tokens, new tokens)] per sequence
SCENARIOS = {
    # context length 1, lengths off the block size, one long sequence among short ones
    "decode": [(0, 1), (4, 1), (14, 1), (1, 1), (70, 1)],
    # cached prefix + new tokens (prefix caching / chunked prefill), fresh prompts and decode rows at once
    "mixed": [(5, 3), (0, 1), (0, 19), (9, 1), (16, 4)],
}


def assert_close(ours: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Same dtype and shape, and values within ``tol`` (absolute and relative)."""
    assert ours.dtype == want.dtype and ours.shape == want.shape
    torch.testing.assert_close(ours.float(), want.float(), atol=tol, rtol=tol)


def randn(*shape: int, dtype=torch.float32, gen=None, device: str | torch.device = "cpu") -> torch.Tensor:
    """Normal samples drawn on the CPU (so a seed gives the same values everywhere), then moved."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def paged_problem(seqs, hq: int, hkv: int, head_dim: int, block_size: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu", seed: int = 0):
    """seqs: [(cached, new)] -> (query, k_cache, v_cache, meta), context in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    ids = list(range(sum(need) + 2))
    random.Random(seed).shuffle(ids)
    tables = [ids[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    k_cache = torch.zeros(len(ids), block_size, hkv, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    total = sum(c + n for c, n in seqs)
    store = AttentionMetadata.build([0] * len(seqs), [c + n for c, n in seqs], tables, block_size, device)
    reference.store_kv_cache(randn(total, hkv, head_dim, dtype=dtype, gen=gen, device=device),
                             randn(total, hkv, head_dim, dtype=dtype, gen=gen, device=device), k_cache, v_cache,
                             store.slot_mapping)
    meta = AttentionMetadata.build([c for c, _ in seqs], [n for _, n in seqs], tables, block_size, device)
    return randn(meta.num_tokens, hq, head_dim, dtype=dtype, gen=gen, device=device), k_cache, v_cache, meta


def check_store_kv_cache(store_kv_cache, dtype: torch.dtype, device: str | torch.device) -> None:
    """``store_kv_cache`` writes strided K/V (split from one fused projection) into the same slots as
    the reference, bit for bit, and skips negative slots."""
    kv = randn(5, 2 * 2 * 64, dtype=dtype, gen=torch.Generator().manual_seed(3), device=device)
    key, value = kv[:, :128].view(5, 2, 64), kv[:, 128:].view(5, 2, 64)
    slots = torch.tensor([13, -1, 2, 31, -5], device=device)
    caches = [torch.zeros(4, 8, 2, 64, dtype=dtype, device=device) for _ in range(4)]
    store_kv_cache(key, value, caches[0], caches[1], slots)
    reference.store_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 3
