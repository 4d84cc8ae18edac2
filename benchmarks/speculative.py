"""Speculative decoding on the default model: output tokens/s with and without ``--speculative ngram``, at
1 and 8 streams, on a dataset where prompt lookup helps (``repeat``: the answer copies a passage of the
prompt), one meant not to (``random`` words) and the shipped ``multi-turn`` chats, with the acceptance
rate.

    python benchmarks/speculative.py [--streams 1 8] [--waves 4] [--num-speculative-tokens 8] [--compare-backoff]

Both engines live in this process (`core bench offline`'s runner, a warm-up request each) and take turns
wave by wave. C streams means waves of C requests submitted at once; tokens/s is all output tokens over
the summed wall time of the waves. Greedy, no ignore_eos (the repeat
answers end where the passage ends). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess

from core.bench.datasets import build_requests
from core.bench.offline import run_offline, warm_up
from core.config import EngineConfig
from core.pipelines import Pipeline
from core.speculative import SpeculativeConfig

# repeat: the answer copies the prompt's passage; random: a completion of random words (the 135M model's
# greedy continuation of those falls into loops, which lookup predicts too); multi-turn: chat answers.
DATASETS = {"repeat": {"input_len": 60, "output_len": 128}, "random": {"input_len": 64, "output_len": 128},
            "multi-turn": {"input_len": 1, "output_len": 128}}


def cpu_name() -> str:
    """lscpu's model name and whether AVX-512 / AMX are there."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    flags = text.split()
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(extras) or 'no avx512/amx'})"


def measure(pipes: dict[str, Pipeline], dataset: str, streams: int, waves: int) -> dict[str, dict]:
    """Per engine: output tokens/s and acceptance over `waves` waves of `streams` requests. The engines
    take turns wave by wave, so a change in the machine's load (it is shared) hits both alike."""
    requests = build_requests(dataset, num_prompts=streams * waves, seed=7, **DATASETS[dataset])
    totals = {name: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0} for name in pipes}
    for wave in range(waves):
        batch = requests[wave * streams : (wave + 1) * streams]
        for name, pipe in pipes.items():
            metrics = run_offline(pipe, batch, ignore_eos=False, progress=False)
            total = totals[name]
            total["tokens"] += metrics.total_output_tokens
            total["seconds"] += metrics.duration_s
            if metrics.spec_decode:
                total["drafted"] += metrics.spec_decode["num_draft_tokens"]
                total["accepted"] += metrics.spec_decode["num_accepted_tokens"]
    return {name: {"tokens_per_s": t["tokens"] / t["seconds"], "output_tokens": t["tokens"],
                   "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None, "draft_tokens": t["drafted"]}
            for name, t in totals.items()}


def engines(k: int, compare_backoff: bool) -> dict[str, EngineConfig]:
    """The engines compared: plain, n-gram, and (optionally) n-gram always proposing K."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=3)
    configs = {"plain": EngineConfig(), "ngram": EngineConfig(speculative=spec)}
    if compare_backoff:
        configs["ngram-no-backoff"] = EngineConfig(speculative=dataclasses.replace(spec, backoff=False))
    return configs


def print_table(results: dict[tuple[str, int], dict[str, dict]], k: int) -> None:
    print(f"CPU: {cpu_name()}; default model, greedy, K = {k}, n-gram 1..3")
    print(f"{'dataset':<10} {'streams':>7} {'engine':<17} {'tok/s':>8} {'speed-up':>9} {'acceptance':>11}")
    for (dataset, streams), by_engine in results.items():
        plain = by_engine["plain"]["tokens_per_s"]
        for name, r in by_engine.items():
            rate = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            print(f"{dataset:<10} {streams:>7} {name:<17} {r['tokens_per_s']:>8.1f} "
                  f"{r['tokens_per_s'] / plain:>8.2f}x {rate:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens)
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--compare-backoff", action="store_true",
                        help="also run n-gram with --no-speculative-backoff (always K drafts)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pipes = {name: Pipeline.from_config(config)
             for name, config in engines(args.num_speculative_tokens, args.compare_backoff).items()}
    try:
        for pipe in pipes.values():
            warm_up(pipe, build_requests("repeat", num_prompts=1, input_len=20, output_len=8)[0])
        results = {(d, c): measure(pipes, d, c, args.waves) for d in args.datasets for c in args.streams}
    finally:
        for pipe in pipes.values():
            pipe.close()
    if args.json:
        print(json.dumps({f"{d}/{c}": r for (d, c), r in results.items()}, indent=2))
    else:
        print_table(results, args.num_speculative_tokens)


if __name__ == "__main__":
    main()
