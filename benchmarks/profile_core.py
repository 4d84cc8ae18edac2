"""Where `core serve` spends its time under load: py-spy samples the server while `core bench serve` drives it.

    python benchmarks/profile_core.py [--concurrency 32] [--num-prompts 64] [--output-len 128] [--top 25]

Starts `core serve` on the default model (no flags: what a user gets), waits for it, then records every
thread of the server with py-spy (`pip install py-spy`; it needs ptrace rights, as root or with
CAP_SYS_PTRACE) while the same fixed ~128-token prompts as the side-by-side run stream through it.
Prints the run's throughput, then the top frames by self time (where the CPU is) and by total time
(which calls contain it), and the share of samples per source area (torch ops, the engine loop, the
HTTP server, ...). The raw collapsed stacks are kept (--raw) for a flame graph.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers.common import free_port, log_tail  # noqa: E402
from peers.process import PeerProcess  # noqa: E402

from core.bench.datasets import fixed_requests  # noqa: E402
from core.bench.metrics import format_report  # noqa: E402
from core.bench.serve import LoadOptions, benchmark_server  # noqa: E402

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
AREAS = [  # first match wins: (area, substring of the frame's file or function)
    ("torch ops (python side of torch)", "/torch/"),
    ("transformers", "/transformers/"),
    ("pytorch backend: model layers", "core_pytorch_backend/layers"),
    ("pytorch backend: kernels", "core_pytorch_backend/kernels"),
    ("pytorch backend: models", "core_pytorch_backend/models"),
    ("pytorch backend: model runner", "core_pytorch_backend/model_runner"),
    ("pytorch backend: engine loop", "core_pytorch_backend/engine"),
    ("pytorch backend: other", "core_pytorch_backend/"),
    ("core scheduling", "core/scheduling"),
    ("core detokenize", "core/detokenize"),
    ("core server", "core/server"),
    ("core engine", "core/"),
    ("tokenizers", "tokenizers"),
    ("HTTP stack (uvicorn, starlette, fastapi, pydantic)", "uvicorn|starlette|fastapi|pydantic|h11|anyio"),
    ("asyncio", "asyncio"),
    ("idle / waiting", "wait|select|sleep|_worker|get (queue"),
]


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw output: one `frame;frame;...;leaf COUNT` line per distinct stack."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py:12)`, site-packages prefixes dropped."""
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    file = match["file"].split("site-packages/")[-1].split("/work/main/")[-1]
    return f"{match['func']} ({file}{':' + match['line'] if match['line'] else ''})"


def area(frame: str) -> str:
    for name, pattern in AREAS:
        if any(part in frame for part in pattern.split("|")):
            return name
    return "other"


def summarise(stacks: list[tuple[list[str], int]], top: int) -> str:
    """Top frames by self and total samples, and samples per area of the innermost Python frame."""
    total = sum(count for _, count in stacks) or 1
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        python = [f for f in frames if FRAME.match(f.strip())] or frames
        self_time[short(python[-1])] += count
        for frame in {short(f) for f in python}:
            inclusive[frame] += count
        areas[area(python[-1])] += count
    lines = [f"{total} samples over all threads", "", "Top frames by self time:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in self_time.most_common(top)]
    lines += ["", "Top frames by total time (the frame or anything it calls):"]
    nested = [(frame, n) for frame, n in inclusive.most_common() if n < total][:top]  # drop the common roots
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in nested]
    lines += ["", "Samples by area (innermost Python frame):"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in areas.most_common()]
    return "\n".join(lines)


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("profile_core.py needs py-spy: pip install py-spy")
    return found


def run(args: argparse.Namespace) -> int:
    spy = py_spy()
    port = free_port()
    command = [sys.executable, "-m", "core.cli", "serve", "--port", str(port),
               "--served-model-name", "smollm2", *shlex.split(args.server_args)]
    server = PeerProcess("core-profiled", command).start()
    raw = args.raw or Path(tempfile.mkdtemp()) / "core-serve.collapsed"
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/health", 300)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(benchmark_server(base, "smollm2", fixed_requests(4, args.input_len, 8, seed=1),
                                     LoadOptions(progress=False)))  # warm-up, not profiled
        recorder = subprocess.Popen([spy, "record", "--pid", str(server.process.pid), "--format", "raw",
                                     "--rate", str(args.rate), "--output", str(raw),
                                     # py-spy reads native stacks only from a stopped process
                                     *(["--native"] if args.native else ["--nonblocking"])],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        requests = fixed_requests(args.num_prompts, args.input_len, args.output_len, seed=0)
        metrics = asyncio.run(benchmark_server(base, "smollm2", requests,
                                               LoadOptions(max_concurrency=args.concurrency), check=False))
        recorder.send_signal(2)  # SIGINT: py-spy writes its output and exits
        spy_output = recorder.communicate(timeout=60)[0]
    finally:
        server.stop()
    if not raw.is_file():
        raise SystemExit(f"py-spy wrote nothing: {spy_output.strip()[-500:]} / server: {log_tail(server.log_path)}")
    print(format_report(metrics, f"core serve at concurrency {args.concurrency}"))
    print(summarise(parse_collapsed(raw.read_text()), args.top))
    print(f"\nraw collapsed stacks: {raw} (flame graph: flamegraph.pl or speedscope)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--raw", type=Path, help="where to keep the collapsed stacks")
    parser.add_argument("--server-args", default="", help="more `core serve` arguments, e.g. '--backend cuda'")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
