"""A decode step's two native paths side by side, alone and beside a process that takes CPU time.

    python benchmarks/decode_contention.py [--batch 16 32 64] [--rounds 8] [--busy-ms 2 --idle-ms 8]

The native decode stack (native_decode.py) takes a step of enough rows (two units a thread) in row
groups, each thread one layer of one group at a time; below that, every kernel splits its work among the
threads. On the default model, greedy, after 128-token prompts, this alternates the two on the same
runner (``core_decoder.group_rows`` 0: the kernels' splits) for ``--rounds`` rounds of 6 decode steps per
batch size, first alone and then beside a process that spins ``--busy-ms`` of every ``--busy-ms +
--idle-ms`` (what a server's event loop and the clients on the same cores do to the engine's threads),
and prints the median step of each and the median of the paired ratios. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import decode_step
import torch

from core_pytorch_backend.native.library import available

SPIN = "import time,sys\nb,i=float(sys.argv[1])/1e3,float(sys.argv[2])/1e3\nwhile True:\n t=time.perf_counter()\n" \
       " while time.perf_counter()-t<b: pass\n time.sleep(i)\n"


def steps_ms(runner, scheduler, group_rows: int, count: int) -> float:
    runner.decode_path.plan.decoder.group_rows = group_rows
    times = []
    for _ in range(count):
        start = time.perf_counter()
        decode_step.step(runner, scheduler)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def compare(runner, scheduler, batch: int, rounds: int, label: str) -> None:
    decode_step.start(runner, scheduler, batch, runner.model.config.vocab_size)
    group_rows = runner.decode_path.plan.decoder.group_rows
    groups, kernels = [], []
    for _ in range(rounds):
        groups.append(steps_ms(runner, scheduler, group_rows, 6))
        kernels.append(steps_ms(runner, scheduler, 0, 6))
    runner.decode_path.plan.decoder.group_rows = group_rows
    decode_step.finish(scheduler)
    ratio = statistics.median(g / k for g, k in zip(groups, kernels, strict=True))
    print(f"B={batch:3d} {label:>14}: row groups {statistics.median(groups):6.1f} ms, kernels' splits "
          f"{statistics.median(kernels):6.1f} ms, paired ratio {ratio:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--idle-ms", type=float, default=8.0)
    args = parser.parse_args()
    runner, scheduler = decode_step.build("auto", max(args.batch))
    print(f"# native decode stack, {runner.dtype}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, kernels {available().variant}", flush=True)
    for batch in args.batch:
        compare(runner, scheduler, batch, args.rounds, "alone")
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(args.busy_ms), str(args.idle_ms)])
    try:
        for batch in args.batch:
            compare(runner, scheduler, batch, args.rounds, f"busy {args.busy_ms:g}/{args.busy_ms + args.idle_ms:g} ms")
    finally:
        spinner.kill()
        spinner.wait()


if __name__ == "__main__":
    main()
