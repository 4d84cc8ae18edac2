"""Two builds of the CPU kernels side by side in one process: decode steps alternate between them.

    python benchmarks/kernel_ab.py [--base HEAD] [--batch 32 64] [--steps 40]

These VMs drift by 10-20% within minutes, so two runs of `decode_step.py`, one per build, cannot show a
change of a few percent. Here the working tree's kernels (csrc/) and those of git revision --base are
built side by side, the default model is loaded once, `--batch` sequences are prefilled, and then decode
steps run through the native decode stack with each build in turn (A B, B A, ...), on the same weights
and KV cache: a pair of neighbouring steps sees the same machine. Prints per batch size each build's
median step and the median of the pairs' ratios (B / A: below 1, the working tree is faster). Both builds
must have the C ABI this checkout's Python expects (library.ABI_VERSION); the steps' results are the
same whichever build runs a step only where the change keeps the arithmetic (else the sequences drift
apart, which does not change what is timed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import core_pytorch_backend  # noqa: F401  (before torch: large tensors on huge pages, as the server has them)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_step import build, finish, start, step  # noqa: E402

CSRC = "plugins/pytorch_backend/core_pytorch_backend/native/csrc"


def sources_at(revision: str, into: Path) -> Path:
    """The kernels' C files of git ``revision``, written into ``into``."""
    root = HERE.parent
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], cwd=root, check=True,
                              capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def decoder_functions(base: str):
    """{"A": the base revision's, "B": the working tree's} ``core_decoder_layers``."""
    from core_pytorch_backend.native.build import build_library
    from core_pytorch_backend.native.library import CpuKernels

    with tempfile.TemporaryDirectory() as tmp:
        base_path = build_library(sources=sources_at(base, Path(tmp)))
    tree_path = build_library()
    print(f"# A = {base}: {base_path.name}\n# B = working tree: {tree_path.name}")
    return {"A": CpuKernels(base_path).function("core_decoder_layers"),
            "B": CpuKernels(tree_path).function("core_decoder_layers")}


def measure(runner, scheduler, functions: dict, batch: int, steps: int) -> None:
    start(runner, scheduler, batch, runner.model.config.vocab_size)
    for _ in range(3):
        step(runner, scheduler)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in functions}
    for pair in range(steps):
        order = list(functions.items())
        for name, function in order if pair % 2 == 0 else order[::-1]:  # A B, B A, ...: neither always first
            runner.decode_path.function = function
            began = time.perf_counter()
            step(runner, scheduler)
            times[name].append((time.perf_counter() - began) * 1e3)
    finish(scheduler)
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    low, middle, high = statistics.quantiles(ratios, n=4)
    print(f"B={batch:<3} A median {statistics.median(times['A']):.2f} ms, B median {statistics.median(times['B']):.2f}"
          f" ms; B / A per pair: median {middle:.3f} (quartiles {low:.3f}-{high:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are A (default HEAD)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--steps", type=int, default=40, help="pairs of decode steps per batch size")
    args = parser.parse_args()
    functions = decoder_functions(args.base)
    runner, scheduler = build("auto", max(args.batch))
    if runner.decode_path is None:
        raise SystemExit("the native decode stack is off for this model or machine: nothing to compare")
    for batch in args.batch:
        measure(runner, scheduler, functions, batch, args.steps)


if __name__ == "__main__":
    main()
