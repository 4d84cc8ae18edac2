"""Cost of the CPU's paged attention (the reference and the native op sets) as the context grows.

    python benchmarks/attention_context.py [--contexts 128 1024 4096] [--dtype bfloat16 float32 float32/bfloat16]
                                           [--ops reference native]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64) over a paged cache of
block_size 16 (EngineConfig's default), blocks scattered at random as a long-running server leaves
them. Per context length it times one decode token and one 128-token prefill chunk that ends at that
context (medians over interleaved repeats, microseconds), then the cost per 1k tokens of context:
flat or falling means cost grows no worse than linearly. ``float32/bfloat16`` is a float32 query over a
bfloat16 cache, as the default GGUF model runs. A decode step's plan (block ids, mask) is
built once per step and shared by all 30 layers, so it is built outside the timed call, as in a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from core.config import EngineConfig
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import kv_int8, select_ops

HEADS, KV_HEADS, HEAD_DIM, CHUNK = 9, 3, 64, 128


DTYPES = {"bfloat16": (torch.bfloat16, torch.bfloat16), "float32": (torch.float32, torch.float32),
          "float32/bfloat16": (torch.float32, torch.bfloat16),
          "float32/int8": (torch.float32, kv_int8.DTYPE)}  # name -> (query dtype, cache dtype)


def random_cache(blocks: int, block_size: int, cache_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A cache of random rows (an int8 cache's quantized from them, as core_store_kv writes it)."""
    values = torch.randn(blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    return kv_int8.quantize(values) if kv_int8.is_int8(cache_dtype) else values.to(cache_dtype)


def case(context: int, new: int, dtypes: tuple[torch.dtype, torch.dtype], block_size: int):
    """(query, k_cache, v_cache, meta) for one sequence of ``context`` tokens, the last ``new`` of them new."""
    query_dtype, cache_dtype = dtypes
    blocks = -(-context // block_size)
    gen = torch.Generator().manual_seed(context)
    k_cache = random_cache(blocks + 8, block_size, cache_dtype, gen)
    v_cache = random_cache(blocks + 8, block_size, cache_dtype, gen)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].tolist()
    meta = AttentionMetadata.build([context - new], [new], [table], block_size)
    query = torch.randn(new, HEADS, HEAD_DIM, generator=gen).to(query_dtype)
    return query, k_cache, v_cache, meta


def time_us(fn, repeats: int, calls: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--ops", nargs="+", default=["reference", "native"], choices=["reference", "native"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    block_size = EngineConfig().block_size
    scale = HEAD_DIM**-0.5
    print(f"# paged attention, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, block_size {block_size}, "
          f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'ops':>9} {'dtype':>16} {'context':>8} {'decode us':>10} {'us/1k ctx':>10} {'chunk128 us':>12} "
          f"{'us/1k ctx':>10}")
    with torch.inference_mode():
        for name in args.dtype:
            for context in args.contexts:
                for kind in args.ops:
                    print(row(select_ops("cpu", kind=kind), name, context, block_size, scale, args.repeats))


def row(ops, name: str, context: int, block_size: int, scale: float, repeats: int) -> str:
    dtype = DTYPES[name]
    q, k_cache, v_cache, meta = case(context, 1, dtype, block_size)
    chunk = case(context, min(CHUNK, context), dtype, block_size)
    ops.paged_attention(q, k_cache, v_cache, meta, scale)  # builds the step's plan once
    calls = max(3, 200_000 // context)
    d_us = time_us(lambda: ops.paged_attention(q, k_cache, v_cache, meta, scale), repeats, calls)
    c_us = time_us(lambda: ops.paged_attention(*chunk, scale), repeats, max(2, calls // 16))
    return (f"{ops.name:>9} {name:>16} {context:>8} {d_us:>10.1f} {d_us * 1024 / context:>10.1f} {c_us:>12.1f} "
            f"{c_us * 1024 / context:>10.1f}")


if __name__ == "__main__":
    main()
