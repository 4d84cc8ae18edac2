"""Paged attention layer and the helpers a model runner uses to bind KV caches to it."""

from __future__ import annotations

import math
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
    whatever the op set (but a soft cap alone, which an op set's ``softcapped_attention`` takes where it has one: the
    native set's decode kernel): ``softcap`` (Gemma 2), ``alibi_slopes`` [num_heads] (ALiBi: Bloom, MPT; float32
    whatever the model's dtype, as transformers keeps its bias: no buffer, which a cast would round) and
    ``sinks`` (gpt-oss: the layer's parameter ``sinks`` [num_heads], one more logit per head in the softmax,
    loaded from the checkpoint). ``v_head_dim``: V's head width where it is narrower than Q's and K's
    (DeepSeek's MLA served as plain multi-head attention): V is zero-padded to ``head_dim`` in the cache and
    the output is ``num_heads * v_head_dim`` wide. ``kv_source``: the index of an earlier layer whose KV
    cache this one reads instead of owning one (Gemma 4's ``num_kv_shared_layers``): the runner binds that
    layer's cache to it, and it stores nothing (its ``k`` and ``v`` are None).
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
        kv_source: int | None = None,
        chunk: int | None = None,
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
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()  # no buffer: a cast would round it
        self.v_head_dim = v_head_dim or head_dim
        self.kv_source = kv_source
        self.chunk = chunk
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
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq * D], k and v [T, Hkv * D] (None in a layer reading another's cache) -> [T, Hq * D]."""
        if meta.interrupt is not None:
            meta.interrupt()  # raises when every request of the step was aborted (step_interrupt.py)
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_index} has no KV cache bound: the runner must call "
                "bind_kv_caches(model, ...) before a forward (and after waking from sleep)"
            )
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        if self.kv_source is None:  # the source layer stored this step's K/V before this one runs
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.v_head_dim)
            if self.v_head_dim < self.head_dim:
                v = nn.functional.pad(v, (0, self.head_dim - self.v_head_dim))
            self.ops.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        capped = getattr(self.ops, "softcapped_attention", None) if self.only_softcapped else None
        if capped is not None:  # the op set's own kernels cap the scores (the native decode stack's, on the CPU)
            out = capped(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.softcap)
        elif self.has_score_terms:
            out = reference.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window,
                                            self.softcap, alibi_slopes=self._slopes_on(q.device), sinks=self.sinks,
                                            chunk=self.chunk)
        else:
            out = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)
        return out[..., : self.v_head_dim].reshape(t, self.num_heads * self.v_head_dim)

    def _slopes_on(self, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is not None and self.alibi_slopes.device != device:
            self.alibi_slopes = self.alibi_slopes.to(device)
        return self.alibi_slopes

    @property
    def has_score_terms(self) -> bool:
        """Whether the scores take more than the scaled dot products (the reference attention then runs)."""
        return bool(self.softcap) or self.sinks is not None or self.alibi_slopes is not None or self.chunk is not None

    @property
    def only_softcapped(self) -> bool:
        """Whether Gemma 2's soft cap is the only score term (which an op set's ``softcapped_attention`` takes)."""
        return bool(self.softcap) and self.sinks is None and self.alibi_slopes is None and self.chunk is None


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, in layer order."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return sorted(layers, key=lambda m: m.layer_index)


def kv_cache_owners(model: nn.Module) -> list[Attention]:
    """The attention layers that own a KV cache, in layer order (not those reading another layer's)."""
    return [layer for layer in attention_layers(model) if layer.kv_source is None]


def kv_cache_shape(layer: Attention, num_blocks: int, block_size: int,
                   dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """Shape of ``layer``'s K (or V) cache of ``dtype`` (an int8 cache's rows are wider: ``kv_int8``); layers
    may differ (Gemma 4's global layers have wider heads, and fewer of them, than its sliding ones)."""
    width = layer.head_dim if dtype is None else kv_int8.row_width(layer.head_dim, dtype)
    return (num_blocks, block_size, layer.num_kv_heads, width)


def bind_kv_caches(model: nn.Module, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Bind one (k_cache, v_cache) pair per cache-owning layer (``kv_cache_owners``), in layer order; a layer
    with a ``kv_source`` gets that layer's pair."""
    owners = kv_cache_owners(model)
    if len(caches) != len(owners):
        raise ValueError(f"model has {len(owners)} attention layers owning a KV cache, got {len(caches)} "
                         "cache pairs")
    by_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, (k_cache, v_cache) in zip(owners, caches, strict=True):
        layer.bind_kv_cache(k_cache, v_cache)
        by_layer[layer.layer_index] = (k_cache, v_cache)
    for layer in attention_layers(model):
        if layer.kv_source is not None:
            if layer.kv_source not in by_layer:
                raise ValueError(f"layer {layer.layer_index} reads the KV cache of layer {layer.kv_source}, "
                                 "which owns none")
            layer.bind_kv_cache(*by_layer[layer.kv_source])


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
    """Allocate the caches of every cache-owning layer (model dtype/device by default) and bind them.

    All layers' K and V are views of one allocation, layer by layer, K then V: where the layers' caches
    have one shape, the tensor ``[layers, 2, num_blocks, block_size, Hkv, D]`` (an int8 cache's rows
    ``D + kv_int8.ROW_EXTRA`` bytes wide). With
    ``zeroed=False`` its memory is left as allocated, and the caller zeroes each block before a step
    first reads it (``ModelRunner`` does on the CPU: one large fresh allocation costs no resident
    memory until it is written, so the cache's footprint grows with use). Such a CPU cache is kept off
    transparent huge pages (the package asks torch for them: see ``core_pytorch_backend``), which would
    make each of the 2 x layers regions resident 2 MiB at a time.
    """
    param = next(model.parameters())
    dtype = dtype or param.dtype
    device = device or param.device
    shapes = [kv_cache_shape(layer, num_blocks, block_size, dtype) for layer in kv_cache_owners(model)]
    sizes = [math.prod(shape) for shape in shapes]
    allocate = torch.zeros if zeroed else torch.empty
    storage = allocate(2 * sum(sizes), dtype=dtype, device=device)
    if not zeroed and storage.device.type == "cpu":
        _small_pages(storage)
    caches, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        k_cache, v_cache = storage[start : start + 2 * size].view(2, *shape)
        caches.append((k_cache, v_cache))
        start += 2 * size
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
