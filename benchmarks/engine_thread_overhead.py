"""The same decode step timed on the main thread and on a worker thread (where the engine loop runs).

    python benchmarks/engine_thread_overhead.py [--dtype bfloat16] [--steps 20]

SmolLM2 at batch 1, one sequence of ~100 cached tokens, through the pytorch backend's own model and the
reference ops: milliseconds per decode step (forward + LM head) when torch is called from the main
thread, from a `threading.Thread` while the main thread's OpenMP workers are still alive, and from a
thread after `core.openmp.release_openmp_pool()` freed them on the main thread (what the backend does
once it has loaded). On this project's 2-core AVX2 machine: 35, 56 and 34 ms/step (bf16). The middle
case is libgomp managing 4 threads on 2 CPUs and putting its workers to sleep between ops. Numbers only;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from core.openmp import release_openmp_pool
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


def on_a_thread(step, steps: int) -> float:
    box: list[float] = []
    worker = threading.Thread(target=lambda: box.append(time_steps(step, steps)))
    worker.start()
    worker.join()
    return box[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = load_checkpoint(default_model_path(), dtype=args.dtype).model
    allocate_kv_caches(model, 64, BLOCK_SIZE)
    step = make_step(model)
    results = {"main thread": time_steps(step, args.steps),
               "thread, main's pool alive": on_a_thread(step, args.steps)}
    release_openmp_pool()
    results["thread, main's pool freed"] = on_a_thread(step, args.steps)
    print(f"decode step, batch 1, {args.dtype}, {torch.get_num_threads()} torch threads:")
    for where, ms in results.items():
        print(f"  {where:<26} {ms:6.1f} ms/step")


if __name__ == "__main__":
    main()
