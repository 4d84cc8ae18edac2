"""Paged attention layer and the helpers a model runner uses to bind KV caches to it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..kernels import kv_int8, reference


class Attention(nn.Module):
    """Stores the step's new K/V in this layer's cache, then attends over each sequence's context.

    The cache tensors are bound by the runner (``bind_kv_cache``) and are not part of the state
    dict; ``unbind_kv_cache`` drops them (e.g. KV freed while sleeping).

    What a layer adds to the scores (``reference.ScoreTerms``) runs the plain-torch reference attention,
    whatever the op set: ``softcap`` (Gemma 2), ``alibi_slopes`` [num_heads] (ALiBi: Bloom, MPT; a
    non-persistent buffer) and ``sinks`` (gpt-oss: the layer's parameter ``sinks`` [num_heads], one more
    logit per head in the softmax, loaded from the checkpoint). ``v_head_dim``: V's head width where it is
    narrower than Q's and K's (DeepSeek's MLA served as plain multi-head attention): V is zero-padded to
    ``head_dim`` in the cache and the output is ``num_heads * v_head_dim`` wide.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        ops: Any,
        sliding_window: int | None = None,
        layer_index: int = 0,
        softcap: float | None = None,
        *,
        sinks: bool = False,
        alibi_slopes: torch.Tensor | None = None,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if v_head_dim is not None and not 0 < v_head_dim <= head_dim:
            raise ValueError(f"v_head_dim {v_head_dim} must be in 1..head_dim ({head_dim})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        self.sliding_window = sliding_window
        self.layer_index = layer_index
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.v_head_dim = v_head_dim or head_dim
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, kv_int8.row_width(self.head_dim, k_cache.dtype))
        for cache in (k_cache, v_cache):
            if cache.dim() != 4 or tuple(cache.shape[2:]) != expected or cache.dtype != k_cache.dtype:
                raise ValueError(
                    f"layer {self.layer_index}: KV cache must be [num_blocks, block_size, {expected[0]}, "
                    f"{expected[1]}], got {tuple(cache.shape)}"
                )
        self.k_cache, self.v_cache = k_cache, v_cache

    def unbind_kv_cache(self) -> None:
        self.k_cache = self.v_cache = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq * D], k and v [T, Hkv * D] -> [T, Hq * D]."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_index} has no KV cache bound: the runner must call "
                "bind_kv_caches(model, ...) before a forward (and after waking from sleep)"
            )
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.v_head_dim)
        if self.v_head_dim < self.head_dim:
            v = nn.functional.pad(v, (0, self.head_dim - self.v_head_dim))
        self.ops.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.has_score_terms:
            out = reference.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window,
                                            self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks)
        else:
            out = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)
        return out[..., : self.v_head_dim].reshape(t, self.num_heads * self.v_head_dim)

    @property
    def has_score_terms(self) -> bool:
        """Whether the scores take more than the scaled dot products (the reference attention then runs)."""
        return bool(self.softcap) or self.sinks is not None or self.alibi_slopes is not None


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return sorted(layers, key=lambda m: m.layer_index)


def kv_cache_shape(model: nn.Module, num_blocks: int, block_size: int,
                   dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache of ``dtype`` (an int8 cache's rows are wider: ``kv_int8``); all
    layers of the built-in models share it."""
    first = attention_layers(model)[0]
    width = first.head_dim if dtype is None else kv_int8.row_width(first.head_dim, dtype)
    return (num_blocks, block_size, first.num_kv_heads, width)


def bind_kv_caches(model: nn.Module, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Bind one (k_cache, v_cache) pair per attention layer, in layer order."""
    layers = attention_layers(model)
    if len(caches) != len(layers):
        raise ValueError(f"model has {len(layers)} attention layers, got {len(caches)} cache pairs")
    for layer, (k_cache, v_cache) in zip(layers, caches, strict=True):
        layer.bind_kv_cache(k_cache, v_cache)


def unbind_kv_caches(model: nn.Module) -> None:
    for layer in attention_layers(model):
        layer.unbind_kv_cache()


def allocate_kv_caches(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    zeroed: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate every layer's caches (model dtype/device by default) and bind them.

    All layers' K and V are views of one tensor ``[layers, 2, num_blocks, block_size, Hkv, D]`` (an int8
    cache's rows ``D + kv_int8.ROW_EXTRA`` bytes wide). With
    ``zeroed=False`` its memory is left as allocated, and the caller zeroes each block before a step
    first reads it (``ModelRunner`` does on the CPU: one large fresh allocation costs no resident
    memory until it is written, so the cache's footprint grows with use). Such a CPU cache is kept off
    transparent huge pages (the package asks torch for them: see ``core_pytorch_backend``), which would
    make each of the 2 x layers regions resident 2 MiB at a time.
    """
    param = next(model.parameters())
    dtype = dtype or param.dtype
    device = device or param.device
    layers = attention_layers(model)
    shape = (len(layers), 2, *kv_cache_shape(model, num_blocks, block_size, dtype))
    allocate = torch.zeros if zeroed else torch.empty
    storage = allocate(shape, dtype=dtype, device=device)
    if not zeroed and storage.device.type == "cpu":
        _small_pages(storage)
    caches = [(storage[i, 0], storage[i, 1]) for i in range(len(layers))]
    bind_kv_caches(model, caches)
    return caches


MADV_NOHUGEPAGE = 15  # Linux <sys/mman.h>
PAGE = 4096


def _small_pages(tensor: torch.Tensor) -> None:
    """madvise(MADV_NOHUGEPAGE) over ``tensor``'s whole pages, before anything touches them (Linux; a
    no-op where libc or the call is missing)."""
    import ctypes

    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_NOHUGEPAGE)
    except (OSError, AttributeError):
        pass
