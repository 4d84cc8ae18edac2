"""The same decode step timed on the main thread and on a worker thread (where the engine loop runs).

    python benchmarks/engine_thread_overhead.py [--dtype bfloat16] [--steps 20]

SmolLM2 at batch 1, one sequence of ~100 cached tokens, through the pytorch backend's own model and the
reference ops: milliseconds per decode step (forward + LM head) when torch is called from the main thread,
from a `threading.Thread`, and from an asyncio executor thread while the event loop waits. On this
project's 2-core AVX2 machine the worker threads were ~1.6x slower (35 vs 56 ms/step, bf16): the engine
loop pays that on every step. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers.attention import allocate_kv_caches
from core_pytorch_backend.loader import default_model_path, load_checkpoint

BLOCK_SIZE = 16


def make_step(model):
    table = [list(range(16))]

    def step(position: int) -> None:
        meta = AttentionMetadata.build([position], [1], table, BLOCK_SIZE)
        with torch.inference_mode():
            model.compute_logits(model(torch.tensor([5]), meta.positions(), meta))

    return step


def time_steps(step, steps: int) -> float:
    for position in range(100, 105):
        step(position)
    start = time.perf_counter()
    for position in range(110, 110 + steps):
        step(position)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = load_checkpoint(default_model_path(), dtype=args.dtype).model
    allocate_kv_caches(model, 64, BLOCK_SIZE)
    step = make_step(model)
    results = {"main thread": time_steps(step, args.steps)}
    box: list[float] = []
    worker = threading.Thread(target=lambda: box.append(time_steps(step, args.steps)))
    worker.start()
    worker.join()
    results["threading.Thread"] = box[0]

    async def in_executor() -> float:
        return await asyncio.get_running_loop().run_in_executor(None, time_steps, step, args.steps)

    results["asyncio executor thread"] = asyncio.run(in_executor())
    print(f"decode step, batch 1, {args.dtype}, {torch.get_num_threads()} torch threads:")
    for where, ms in results.items():
        print(f"  {where:<24} {ms:6.1f} ms/step")


if __name__ == "__main__":
    main()
