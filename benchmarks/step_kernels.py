"""Where a prefill step and a decode step of the default model go, kernel by kernel.

    python benchmarks/step_kernels.py [--prompts 64] [--prompt-len 128] [--decode-steps 20] [--amx-rows all]
        [--kv-cache-dtype int8]

Runs the engine loop's step by hand (as benchmarks/decode_step.py does, through the modules: every
kernel is a separate call, so each can be timed) on the calling thread: ``--prompts`` prompts of
``--prompt-len`` tokens prefilled in one step (after one warm-up round), then ``--decode-steps`` decode
steps of them all. Each native kernel call (``native/library.py``) is timed; the rest of the step is
"outside kernels" (Python, torch ops, the scheduler). Prints seconds per kernel for the prefill and
milliseconds per decode step.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step  # noqa: E402

from core_pytorch_backend.native.library import CpuKernels  # noqa: E402

TIMES: collections.defaultdict[str, float] = collections.defaultdict(float)
COUNTS: collections.Counter[str] = collections.Counter()


def time_kernels() -> None:
    """Wrap every kernel the library hands out (``function`` and ``call``) with a timer."""
    original = CpuKernels.function

    def function(self, name):
        kernel = original(self, name)

        def timed(*args):
            start = time.perf_counter()
            status = kernel(*args)
            TIMES[name] += time.perf_counter() - start
            COUNTS[name] += 1
            return status
        return timed

    def call(self, name, *args):
        status = function(self, name)(*args)
        if status:
            self.raise_for(name, status)

    CpuKernels.function, CpuKernels.call = function, call


def report(title: str, total: float, per: float, unit: str, scale: float) -> None:
    print(f"{title}: {total * scale / per:.2f} {unit}")
    for name, seconds in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {seconds * scale / per:8.2f} {unit}  ({COUNTS[name] / per:.0f} calls)")
    print(f"  {'outside kernels':28s} {(total - sum(TIMES.values())) * scale / per:8.2f} {unit}")
    TIMES.clear()
    COUNTS.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--amx-rows", default="prompt", choices=["prompt", "all", "none"],
                        help="native/tile_rows.py's rule (on a CPU with a prompt loop: AVX512-BF16 or AMX)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="the backend option kv_cache_dtype")
    args = parser.parse_args()
    from core.scheduling import Sequence

    time_kernels()
    runner, scheduler = decode_step.build("auto", args.prompts, eager=True, amx_rows=args.amx_rows,
                                          kv_cache_dtype=args.kv_cache_dtype)
    vocab = runner.model.config.vocab_size

    def prefill(round_: int) -> float:
        for i in range(args.prompts):
            scheduler.add(Sequence(f"r{round_}-{i}", [(97 * i + 31 * j + 11 + round_) % (vocab - 100) + 50
                                                      for j in range(args.prompt_len)]))
        start = time.perf_counter()
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in scheduler.running + list(scheduler.waiting)):
            decode_step.step(runner, scheduler)
        return time.perf_counter() - start

    prefill(0)
    decode_step.finish(scheduler)
    TIMES.clear()
    COUNTS.clear()
    report(f"prefill, {args.prompts} x {args.prompt_len} tokens", prefill(1), 1, "s", 1)
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        decode_step.step(runner, scheduler)
    report(f"decode, {args.prompts} rows, per step", time.perf_counter() - start, args.decode_steps, "ms", 1e3)


if __name__ == "__main__":
    main()
