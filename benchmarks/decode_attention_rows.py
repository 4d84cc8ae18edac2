"""A decode step's attention over many sequences, as a server at C streams runs it.

    python benchmarks/decode_attention_rows.py [--rows 8 32 64] [--contexts 128 192 1024]
        [--dtype float32/bfloat16 float32/int8] [--ops native reference] [--layers 30] [--threads 2]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), block_size 16, R decode rows
each over its own context, the blocks scattered at random as a long-running server leaves them. One
"step" calls the op once per layer, each layer with its own caches, so every call reads its K and V from
memory (a step's weights and its other layers' caches evict them in the server) where repeated calls on
one cache would find it warm in L3. Prints per case the median milliseconds of a step, the K and V bytes
read per second, and nanoseconds per position and query head (flat as the context grows: cost linear in
context). `attention_context.py` times one sequence; this times the many-row decode of a busy server.
"""

from __future__ import annotations

import argparse
import statistics
import time

import core_pytorch_backend  # noqa: F401  (before torch: large tensors on huge pages, as the server has them)

# isort: split
import torch
from attention_context import (  # the same shapes, one sequence at a time
    DTYPES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    random_cache,
)

from core.config import EngineConfig
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import select_ops


def step_case(rows: int, context: int, layers: int, dtypes: tuple[torch.dtype, torch.dtype], block_size: int):
    """(query, [(k_cache, v_cache)] per layer, meta): ``rows`` sequences of ``context`` tokens, one new each."""
    query_dtype, cache_dtype = dtypes
    per_row = -(-context // block_size)
    blocks = rows * per_row
    gen = torch.Generator().manual_seed(rows * 7919 + context)
    caches = [tuple(random_cache(blocks, block_size, cache_dtype, gen) for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen).view(rows, per_row).tolist()
    meta = AttentionMetadata.build([context - 1] * rows, [1] * rows, tables, block_size)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(query_dtype)
    return query, caches, meta


def step_ms(ops, query, caches, meta, scale: float, repeats: int) -> float:
    def step() -> None:
        for k_cache, v_cache in caches:
            ops.paged_attention(query, k_cache, v_cache, meta, scale)

    step()  # builds the step's plan once (shared by every layer, as in a step)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 192, 1024])
    parser.add_argument("--dtype", nargs="+", default=["float32/bfloat16"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="+", default=["native"], choices=["reference", "native"])
    parser.add_argument("--layers", type=int, default=30, help="caches the step passes over (SmolLM2: 30)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    block_size = EngineConfig().block_size
    scale = HEAD_DIM**-0.5
    print(f"# decode attention of R rows, {args.layers} layers, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, "
          f"block_size {block_size}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'ops':>9} {'dtype':>16} {'rows':>5} {'context':>8} {'ms/step':>8} {'GB/s':>6} {'ns/pos/head':>12}")
    with torch.inference_mode():
        for name in args.dtype:
            for rows in args.rows:
                for context in args.contexts:
                    query, caches, meta = step_case(rows, context, args.layers, DTYPES[name], block_size)
                    row_bytes = sum(k.shape[-1] * k.element_size() for k, _ in caches)  # an int8 row's scale too
                    kv_bytes = row_bytes * rows * context * KV_HEADS * 2
                    for kind in args.ops:
                        ms = step_ms(select_ops("cpu", kind=kind), query, caches, meta, scale, args.repeats)
                        ns = ms * 1e6 / (args.layers * rows * context * HEADS)
                        print(f"{kind:>9} {name:>16} {rows:>5} {context:>8} {ms:>8.2f} {kv_bytes / ms / 1e6:>6.1f} "
                              f"{ns:>12.2f}", flush=True)
                    del caches


if __name__ == "__main__":
    main()
