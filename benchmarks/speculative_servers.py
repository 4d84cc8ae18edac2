"""Speculative decoding served over HTTP, side by side with llama.cpp's `llama-server`, in one run.

    python benchmarks/speculative_servers.py [--streams 1 8] [--datasets repeat multi-turn] [--prompts 8]

Four servers on the default model's Q4_1 GGUF, one after the other, each loaded the same way by
`core bench serve` (the official openai client over a socket, streamed, greedy):

- `core serve` and `core serve --speculative ngram` (K = 8, n-grams of 1 to 3, back-off on);
- `llama-server` (the build `nox -s bench` makes: benchmarks/peers/llamacpp.py) and `llama-server
  --spec-type ngram-simple` (its prompt-lookup decoding; the build offers draft-model types too, which
  need a second GGUF of the same tokenizer that these machines do not have).

Datasets: `repeat` (the answer copies a passage of the prompt: lookup helps) and `multi-turn` (chat
answers: lookup helps little). C streams: `--max-concurrency C` over max(--prompts, 2 C) requests. Prints
output tokens/s per server, the ratio of each speculating server to its plain one, and core's acceptance
rate (from its /metrics). Each server is warmed up with one request first. Numbers only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from peers import llamacpp  # noqa: E402
from speculative import cpu_name  # noqa: E402

MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(gguf: Path, threads: int) -> dict[str, list[str]]:
    """name -> the command of each server (the port goes in as {port})."""
    core = [sys.executable, "-m", "core.cli", "serve", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
            "--served-model-name", MODEL]
    llama = llamacpp.server_command(gguf, 0, parallel=8, threads=threads)
    llama[llama.index("--port") + 1] = "{port}"
    return {
        "core serve": core,
        "core serve --speculative ngram": [*core, "--speculative", "ngram"],
        "llama-server": llama,
        "llama-server --spec-type ngram-simple": [*llama, "--spec-type", "ngram-simple"],
    }


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server on port {port} after {timeout_s:.0f} s")


def bench(port: int, dataset: str, streams: int, prompts: int) -> dict:
    """One `core bench serve` run's JSON record."""
    command = [sys.executable, "-m", "core.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--model", MODEL, "--dataset", dataset, "--max-concurrency", str(streams), "--num-prompts",
               str(max(prompts, 2 * streams)), "--output-len", "128", "--json", "--no-progress", "--seed", "0"]
    if dataset == "repeat":
        command += ["--input-len", "60"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run_server(name: str, command: list[str], args) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    process = subprocess.Popen([part.replace("{port}", str(port)) for part in command], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, process)
        bench(port, "repeat", 1, 1)  # warm-up
        results = {}
        for dataset in args.datasets:
            for streams in args.streams:
                record = bench(port, dataset, streams, args.prompts)
                results[dataset, streams] = record
                spec = record.get("spec_decode") or {}
                rate = f", acceptance {spec['acceptance_rate']:.2f}" if spec.get("acceptance_rate") is not None else ""
                print(f"  {name}: {dataset} x{streams}: {record['output_throughput']:.1f} tok/s{rate}",
                      file=sys.stderr, flush=True)
        return results
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--datasets", nargs="+", default=["repeat", "multi-turn"], choices=["repeat", "multi-turn"])
    parser.add_argument("--prompts", type=int, default=8, help="requests per level (at least 2 x streams)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    from core_pytorch_backend.default_model import default_model_path

    gguf = default_model_path()
    results = {name: run_server(name, command, args) for name, command in servers(gguf, args.threads).items()}
    print(f"\n{gguf.name}, {cpu_name()}, {args.threads} threads; greedy, streamed, 128 output tokens at most; "
          f"output tokens/s (speed-up over the same server without speculation)\n")
    print("| dataset | streams | core serve | core --speculative ngram | acceptance | llama-server | "
          "llama-server --spec-type ngram-simple |")
    print("|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        for streams in args.streams:
            tput = {name: results[name][dataset, streams]["output_throughput"] for name in results}
            spec = results["core serve --speculative ngram"][dataset, streams].get("spec_decode") or {}
            rate = spec.get("acceptance_rate")
            core, core_spec = tput["core serve"], tput["core serve --speculative ngram"]
            llama, llama_spec = tput["llama-server"], tput["llama-server --spec-type ngram-simple"]
            print(f"| {dataset} | {streams} | {core:.1f} | {core_spec:.1f} ({core_spec / core:.2f}x) | "
                  f"{'-' if rate is None else f'{rate:.2f}'} | {llama:.1f} | {llama_spec:.1f} "
                  f"({llama_spec / llama:.2f}x) |")


if __name__ == "__main__":
    main()
