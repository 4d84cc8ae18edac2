"""The cuda backend's op set: the reference ops' signatures over the hand-written kernels.

Every op validates devices, dtypes, shapes and strides with a ValueError naming the argument, allocates
its outputs with torch (the caching allocator, so CUDA-graph capture works) and launches on the current
stream. Nothing here synchronises with the host: sizes come from tensor shapes and the metadata's host
fields, never from ``.item()`` or ``.tolist()``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from core_cuda_backend.library import DTYPE_NAMES, KernelLibrary, load_library
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import OP_NAMES, reference
from core_pytorch_backend.kernels.reference import gelu_tanh_and_mul  # noqa: F401  (elementwise torch, graph-safe)

NAME = "cuda"
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head the decode kernel holds
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _library() -> KernelLibrary:
    return load_library()


def _stream(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _dtype_code(op: str, name: str, tensor: torch.Tensor) -> int:
    if tensor.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    return DTYPE_NAMES[str(tensor.dtype).removeprefix("torch.")]


def _check(op: str, name: str, tensor: torch.Tensor, *, dim: int | None = None, dtype=None,
           contiguous: bool = False, device: torch.device | None = None) -> None:
    """Device, rank, dtype and layout checks with an error that names the op and the argument."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{op}: {name} must be on a CUDA device, got {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, the other inputs on {device}")
    if dim is not None and tensor.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {tensor.dtype}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    if not contiguous and tensor.numel() and tensor.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dimension, got strides {tensor.stride()}")


def _check_cache(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(op, name, cache, dim=4, contiguous=True)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} vs "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([T, Hkv, D]) into its cache slot; negative slots are skipped."""
    op = "store_kv_cache"
    _check_cache(op, k_cache, v_cache)
    key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    for name, tensor in (("key", key), ("value", value)):
        _check(op, name, tensor, dim=3, device=k_cache.device)
        if tuple(tensor.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"{op}: {name} is {tuple(tensor.shape)}, the cache holds [.., .., "
                             f"{k_cache.shape[2]}, {k_cache.shape[3]}] rows")
    _check(op, "slot_mapping", slot_mapping, dim=1, dtype=torch.int64, contiguous=True, device=k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"{op}: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    _library().call(
        "core_store_kv_cache", key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2], key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), _dtype_code(op, "k_cache", k_cache), _stream(k_cache),
    )


def _check_attention(op: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> None:
    _check_cache(op, k_cache, v_cache)
    _check(op, "query", query, dim=3, dtype=k_cache.dtype, device=k_cache.device)
    head_dim, num_kv_heads = query.shape[2], k_cache.shape[2]
    if head_dim not in HEAD_DIMS or k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: head_dim must be one of {HEAD_DIMS} in query and cache, got "
                         f"{head_dim} and {k_cache.shape[3]}")
    if query.shape[1] % num_kv_heads or query.shape[1] // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{op}: query heads ({query.shape[1]}) must be a multiple of the cache's KV heads "
                         f"({num_kv_heads}), at most {MAX_GROUP} per KV head")
    if k_cache.data_ptr() % 32 or v_cache.data_ptr() % 32:
        raise ValueError(f"{op}: k_cache and v_cache must be 32-byte aligned (vector loads)")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        _check(op, f"meta.{name}", getattr(meta, name), dtype=torch.int32, contiguous=True, device=k_cache.device)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each new token ([T, Hq, D]) over its sequence's paged context -> [T, Hq, D].

    An all-decode step takes the split-context decode kernel; any other step the prefill/extend kernel."""
    op = "paged_attention"
    if any(getattr(meta, "bidirectional_spans", None) or ()):  # Gemma 3 image prefill: the reference has them
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    _check_attention(op, query, k_cache, v_cache, meta)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{op}: sliding_window must be positive or None, got {sliding_window}")
    window = sliding_window or 0
    num_seqs = meta.seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    common = (k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(), meta.block_tables.shape[1])
    sizes = (query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1], float(scale), window)
    code, stream = _dtype_code(op, "query", query), _stream(query)
    if meta.is_decode:
        if query.shape[0] != num_seqs:
            raise ValueError(f"{op}: a decode step needs one query per sequence, got {query.shape[0]} for {num_seqs}")
        _decode(query, out, meta, common, sizes, code, stream)
    else:
        _library().call("core_paged_prefill_attention", query.data_ptr(), query.stride(0), query.stride(1), *common,
                        meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), out.data_ptr(), num_seqs,
                        meta.max_query_len, *sizes, code, stream)
    return out


def _decode(query, out, meta, common, sizes, code, stream) -> None:
    """The decode kernel with ceil(max_seq_len / partition) context splits and their float32 workspace."""
    library = _library()
    num_seqs, num_heads, head_dim = query.shape
    splits = max(1, -(-meta.max_seq_len // library.partition_size))
    acc = max_ = sum_ = None
    if splits > 1:
        acc = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        max_ = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=query.device)
        sum_ = torch.empty_like(max_)
    pointers = [t.data_ptr() if t is not None else None for t in (acc, max_, sum_)]
    library.call("core_paged_decode_attention", query.data_ptr(), query.stride(0), query.stride(1), *common,
                 meta.seq_lens.data_ptr(), out.data_ptr(), *pointers, num_seqs, *sizes, splits, code, stream)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as the reference; with ``residual``, returns ``(norm(x + residual), x + residual)``."""
    op = "rms_norm"
    _check(op, "x", x)
    hidden = x.shape[-1]
    _check(op, "weight", weight, dim=1, dtype=x.dtype, contiguous=True, device=x.device)
    if weight.shape[0] != hidden:
        raise ValueError(f"{op}: weight has {weight.shape[0]} elements for a hidden size of {hidden}")
    rows = x.reshape(-1, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_rows, new_residual = None, None
    if residual is not None:
        _check(op, "residual", residual, dtype=x.dtype, device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual is {tuple(residual.shape)}, x is {tuple(x.shape)}")
        res_rows = residual.reshape(-1, hidden)
        new_residual = torch.empty_like(out)
    _library().call(
        "core_rms_norm", rows.data_ptr(), res_rows.data_ptr() if res_rows is not None else None, weight.data_ptr(),
        out.data_ptr(), new_residual.data_ptr() if new_residual is not None else None, rows.shape[0], hidden,
        rows.stride(0), res_rows.stride(0) if res_rows is not None else 0, float(eps),
        _dtype_code(op, "x", x), _stream(x),
    )
    return out if new_residual is None else (out, new_residual)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hkv, D]; caches float32 [max_positions, D / 2]."""
    op = "apply_rotary"
    _check(op, "query", query, dim=3)
    _check(op, "key", key, dim=3, dtype=query.dtype, device=query.device)
    head_dim = query.shape[2]
    if key.shape[0] != query.shape[0] or key.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"{op}: query {tuple(query.shape)} and key {tuple(key.shape)} need the same tokens "
                         "and the same even head size")
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        _check(op, name, cache, dim=2, dtype=torch.float32, contiguous=True, device=query.device)
        if cache.shape[1] != head_dim // 2:
            raise ValueError(f"{op}: {name} is {tuple(cache.shape)}, expected [max_positions, {head_dim // 2}]")
    positions = positions.to(torch.int64).contiguous()
    _check(op, "positions", positions, dim=1, device=query.device)
    if positions.shape[0] != query.shape[0]:
        raise ValueError(f"{op}: {positions.shape[0]} positions for {query.shape[0]} tokens")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    _library().call(
        "core_apply_rotary", query.data_ptr(), key.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
        positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(), query.shape[0], query.shape[1],
        key.shape[1], head_dim, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        _dtype_code(op, "query", query), _stream(query),
    )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    op = "silu_and_mul"
    _check(op, "x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"{op}: the last dimension of x must be even, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    _library().call("core_silu_and_mul", rows.data_ptr(), out.data_ptr(), rows.shape[0], half, rows.stride(0),
                    _dtype_code(op, "x", x), _stream(x))
    return out


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  one_minus_top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                  noise: torch.Tensor) -> torch.Tensor:
    """One token per row of float32 ``logits`` [B, V]: greedy where temperature <= 0, else the exponential
    race over the top-k / top-p / min-p survivors with the given Exp(1) ``noise`` [B, V] -> int64 [B].

    ``top_k`` (int64, 0 = off), ``one_minus_top_p`` and ``min_p`` (float32, 0 = off) are [B] or None."""
    op = "sample_tokens"
    _check(op, "logits", logits, dim=2, dtype=torch.float32)
    batch = logits.shape[0]
    _check(op, "noise", noise, dim=2, dtype=torch.float32, device=logits.device)
    if noise.shape != logits.shape:
        raise ValueError(f"{op}: noise is {tuple(noise.shape)}, logits {tuple(logits.shape)}")
    rows = {"temperature": (temperature, torch.float32), "top_k": (top_k, torch.int64),
            "one_minus_top_p": (one_minus_top_p, torch.float32), "min_p": (min_p, torch.float32)}
    for name, (tensor, dtype) in rows.items():
        if tensor is None and name != "temperature":
            continue
        _check(op, name, tensor, dim=1, dtype=dtype, contiguous=True, device=logits.device)
        if tensor.shape[0] != batch:
            raise ValueError(f"{op}: {name} has {tensor.shape[0]} rows, logits {batch}")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    pointers = [t.data_ptr() if t is not None else None for t in (top_k, one_minus_top_p, min_p)]
    _library().call("core_sample", logits.data_ptr(), logits.stride(0), batch, logits.shape[1],
                    temperature.data_ptr(), *pointers, noise.data_ptr(), noise.stride(0), out.data_ptr(),
                    _stream(logits))
    return out


def op_set() -> SimpleNamespace:
    """The namespace the layers call (as ``select_ops`` builds it, graph-safe), plus the sampler.

    Loading it builds (or finds in the cache) the library for the current GPU, so a build error surfaces
    at backend start-up rather than in the first forward pass."""
    _library()
    ops = {name: globals()[name] for name in OP_NAMES}
    return SimpleNamespace(name=NAME, graph_safe=True, sample_tokens=sample_tokens, **ops)
