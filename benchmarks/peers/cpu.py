"""What CPU the benchmark runs on: model, vendor, cores and the instruction sets that matter for LLM kernels.

Read from /proc/cpuinfo (the flags the kernel exposes, which inside a VM are the ones the hypervisor
passes through), plus torch's own view (`torch.backends.cpu.get_cpu_capability()`, asked in a
subprocess so the harness never imports torch). The results name all of it: the same code runs at very
different speeds with and without AVX-512, bf16 or AMX instructions.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# the /proc/cpuinfo flags the table's readers care about, in the order they are reported
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512cd", "avx512bw",
             "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16", "amx_fp16")
TORCH_CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"
# `--isa-ceiling`: the instruction sets a run may use, to measure every system as on a CPU without the
# rest (an AVX2-only EPYC on a machine with AVX-512); the harness tells each process through this variable
CEILING_VARIABLE = "CORE_BENCH_ISA_CEILING"
ISA_CEILINGS = {"avx2": ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")}


@dataclass(frozen=True)
class Cpu:
    """The CPU as /proc/cpuinfo and torch describe it."""

    model: str
    vendor: str
    cores: int  # logical CPUs this process may run on
    isa: tuple[str, ...]  # the ISA_FLAGS present, in ISA_FLAGS order
    torch_capability: str | None  # e.g. "AVX512"; None where torch could not be asked
    machine: str = platform.machine()
    ceiling: str | None = None  # an ISA_CEILINGS key: the run may use only those of `isa`

    def has(self, *flags: str) -> bool:
        """Whether the run may use every one of `flags` (the CPU has it, and the ceiling allows it)."""
        allowed = ISA_CEILINGS[self.ceiling] if self.ceiling else self.isa
        return all(flag in self.isa and flag in allowed for flag in flags)

    def line(self) -> str:
        """One line for the results page: `CPU: AMD EPYC (AuthenticAMD, x86_64), 2 cores; ISA: ...; ...`."""
        amx = "AMX: " + ("yes" if self.has("amx_tile") else "none")
        torch = f"torch CPU capability: {self.torch_capability or 'unknown'}"
        isa = " ".join(self.isa) or "none of " + ", ".join(ISA_FLAGS[:3])
        where = f"{self.model} ({self.vendor}, {self.machine}), {self.cores} cores"
        limited = ""
        if self.ceiling:
            used = " ".join(flag for flag in self.isa if self.has(flag))
            limited = (f"; **run limited to {self.ceiling}** ({used}), as on a CPU without the rest: core with "
                       f"CORE_CPU_KERNELS={self.ceiling} and ATEN_CPU_CAPABILITY={self.ceiling} (and oneDNN's "
                       "and MKL's ISA limits), llama.cpp built for those instruction sets only, vLLM not run "
                       "(its kernels follow the CPU)")
        return f"CPU: {where}; ISA: {isa}; {amx}; {torch}{limited}"


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def parse_cpu(text: str, cores: int, torch_capability: str | None) -> Cpu:
    """A Cpu from the text of /proc/cpuinfo."""
    fields = cpuinfo_fields(text)
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return Cpu(model=fields.get("model name", "unknown CPU"), vendor=fields.get("vendor_id", "unknown"),
               cores=cores, isa=tuple(f for f in ISA_FLAGS if f in flags), torch_capability=torch_capability)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def torch_capability(python: str = sys.executable, ceiling: str | None = None) -> str | None:
    """torch's CPU capability as `python` (core's environment) reports it (under `ceiling`: with
    ATEN_CPU_CAPABILITY set to it, as core's rows run); None if that fails."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": ceiling} if ceiling else None
    try:
        done = subprocess.run([python, "-c", TORCH_CAPABILITY], capture_output=True, text=True, timeout=120,
                              env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def isa_ceiling() -> str | None:
    """The run's ISA ceiling (`$CORE_BENCH_ISA_CEILING`, set by `side_by_side.py --isa-ceiling`), or None."""
    ceiling = os.environ.get(CEILING_VARIABLE) or None
    if ceiling is not None and ceiling not in ISA_CEILINGS:
        raise ValueError(f"{CEILING_VARIABLE} must be one of {', '.join(ISA_CEILINGS)}, got {ceiling!r}")
    return ceiling


@functools.cache
def _this_cpu(with_torch: bool, ceiling: str | None) -> Cpu:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    capability = torch_capability(ceiling=ceiling) if with_torch else None
    return dataclasses.replace(parse_cpu(text, usable_cores(), capability), ceiling=ceiling)


def this_cpu(with_torch: bool = True) -> Cpu:
    """This machine's CPU under the run's ISA ceiling (read once per process and ceiling)."""
    return _this_cpu(with_torch, isa_ceiling())


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat's first line."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_fraction(seconds: float = 2.0) -> float | None:
    """How busy all CPUs are over `seconds` (0..1), to tell a run that shared the CPUs; None off Linux."""
    try:
        busy0, total0 = _cpu_ticks()
        time.sleep(seconds)
        busy1, total1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(total1 - total0, 1)


@dataclass(frozen=True)
class CpuTicks:
    """Clock ticks since boot: all CPUs' busy and total, and the CPU time of the processes under test."""

    busy: int
    total: int
    ours: int  # the server's process tree and this process (the load generator)


def process_ticks(pid: int) -> int:
    """User + system clock ticks one process has used (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    except (OSError, ValueError, IndexError):
        return 0


def ticks_now(pids: set[int]) -> CpuTicks | None:
    """A CpuTicks reading with `pids` as the processes under test; None off Linux."""
    try:
        busy, total = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return CpuTicks(busy, total, sum(process_ticks(pid) for pid in pids))


def other_work_fraction(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """The share of all CPUs' time between two readings that went to anything but the processes under test
    (another program, the kernel's own threads), 0..1; None without both readings. A server's child process
    that ended in between loses its ticks and counts as other work: an overestimate, never a miss."""
    if before is None or after is None or after.total <= before.total:
        return None
    other = (after.busy - before.busy) - (after.ours - before.ours)
    return min(max(other / (after.total - before.total), 0.0), 1.0)
