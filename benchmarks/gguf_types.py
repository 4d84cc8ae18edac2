"""The GGUF mixes users download, served by core: accuracy against each file's own float32 model, speed and
memory, and llama-server on the same file.

    python benchmarks/gguf_types.py [--types Q4_K_M Q5_K_M Q6_K IQ4_XS Q3_K_S] [--tokens 2000] [--no-serve]
    python benchmarks/gguf_types.py --types F16 BF16     # 16-bit files (native/half_weights.py)
    python benchmarks/gguf_types.py --files MODEL.gguf [--no-accuracy]   # any GGUF file (a MoE model...)

Each file is made from the default model's Q4_1 GGUF by llama.cpp's own `llama-quantize` (built once, like
the side-by-side harness's llama-server, under ~/.cache/core/bench/llama-cpp; `--allow-requantize`: the
weights are Q4_1's, re-quantized), so these are the tensor mixes llama.cpp writes for a model whose rows
of 576 inputs are not a multiple of 256 (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0). Per file: its tensor types;
teacher-forced top-1 agreement and perplexity ratio of `load_checkpoint(file)` against the same file
dequantized to float32 (benchmarks/quant_accuracy.py); then, unless `--no-serve`, `core serve FILE` and
`llama-server` on it, each timed by `core bench serve` (128-word prompts, 128 output tokens, ignore_eos):
decode tok/s at one stream (1 / mean TPOT, 4 requests) and output tok/s at 32 streams (64 requests), and
the server's peak memory (PSS, sampled as the side-by-side harness does: peers/process.py). Numbers only; nothing is asserted. Name the CPU (`lscpu`) next
to any figure taken from it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.common import cache_dir, default_gguf, free_port  # noqa: E402
from peers.llamacpp import server_command, tool_binary  # noqa: E402
from peers.process import PeerProcess  # noqa: E402

STREAMS = ((1, 4), (32, 64))  # (concurrency, requests)
MODEL_NAME = "smollm2"  # the name llama-server's server_command serves it under


def made_file(kind: str, source: Path) -> Path:
    """The default model re-quantized to `kind` by llama-quantize (made once)."""
    out = cache_dir() / "gguf-types" / f"{source.stem}-{kind}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        subprocess.run([str(tool_binary("llama-quantize")), "--allow-requantize", str(source), str(partial), kind,
                        str(os.cpu_count() or 2)], check=True, capture_output=True)
        partial.rename(out)
    return out


def tensor_types(gguf: Path) -> str:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors if len(t.shape) > 1)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def accuracy(gguf: Path, tokens: int) -> tuple[float, float]:
    import quant_accuracy

    row = quant_accuracy.measure(gguf, ["gguf-packed"], tokens, 256)[-1]
    return row[4], row[6]


def served(name: str, command: list[str], port: int) -> tuple[float, float, float]:
    """(decode tok/s at one stream, output tok/s at 32 streams, peak PSS MiB) of the server `command` starts."""
    process = PeerProcess(name, command, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}).start()
    try:
        process.wait_ready(f"http://127.0.0.1:{port}/health", 300)
        results = [bench(port, c, n) for c, n in STREAMS]
    finally:
        peak = process.stop()
    return 1000 / results[0]["tpot_ms"]["mean"], results[1]["output_throughput"], peak


def bench(port: int, concurrency: int, requests: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "core.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                           "--model", MODEL_NAME, "--num-prompts", str(requests), "--input-len", "128", "--output-len", "128",
                           "--ignore-eos", "--max-concurrency", str(concurrency), "--no-progress", "--json"],
                          capture_output=True, text=True)
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: some requests failed (counted in the JSON)
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    result = json.loads(done.stdout)
    if done.returncode:
        print(f"[gguf_types] {concurrency} streams on port {port}: some of the {requests} requests failed "
              f"(the rest measured): {done.stderr.strip()[-300:]}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_S"])
    parser.add_argument("--tokens", type=int, default=2000, help="positions scored (default 2000)")
    parser.add_argument("--no-serve", action="store_true", help="accuracy only")
    parser.add_argument("--files", nargs="+", type=Path, help="these GGUF files instead of --types made ones")
    parser.add_argument("--no-accuracy", action="store_true", help="serving only")
    args = parser.parse_args()

    files = args.files or [made_file(kind, default_gguf()) for kind in args.types]
    rows = []
    for gguf in files:
        kind = gguf.stem if args.files else gguf.stem.rsplit("-", 1)[-1]
        scores = ["-", "-"] if args.no_accuracy else [f"{value:.4f}" for value in accuracy(gguf, args.tokens)]
        row = [kind, tensor_types(gguf), *scores]
        if not args.no_serve:
            port = free_port()
            core = served(f"core-{kind}", [sys.executable, "-m", "core.cli", "serve", str(gguf), "--port", str(port),
                                           "--served-model-name", MODEL_NAME], port)
            port = free_port()
            llama = served(f"llama-server-{kind}", server_command(gguf, port), port)
            row += [f"{core[0]:.1f} / {llama[0]:.1f}", f"{core[1]:.0f} / {llama[1]:.0f}",
                    f"{core[2]:,.0f} / {llama[2]:,.0f}"]
        rows.append(row)
        print(" | ".join(row), file=sys.stderr, flush=True)
    header = ["file", "tensor types", "agreement", "ppl ratio"]
    if not args.no_serve:
        header += ["decode tok/s @1 core / llama", "out tok/s @32 core / llama", "peak PSS MiB core / llama"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
