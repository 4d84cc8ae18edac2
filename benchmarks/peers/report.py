"""The side-by-side results: one Row per system, written as a markdown table, a PNG plot, JSON, and the
README's benchmark section (between two marker comments)."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peers.cpu import Cpu

README_START, README_END = "<!-- side-by-side:start -->", "<!-- side-by-side:end -->"
CORE_KEYS = ("core", "core-best")  # core's rows: each gets its own ratio table against the peers
MODEL_NOTE = ("Model: SmolLM2-135M-Instruct: the Q4_1 GGUF for core, llama.cpp and llama-cpp-python (each "
              "core row says how it served it); the same weights dequantized to bfloat16 for vLLM and "
              "transformers.")


@dataclass
class Row:
    """One system's numbers; `status` is "ok" or "failed: reason" (then the numbers may be missing)."""

    key: str
    label: str
    version: str = ""
    status: str = "ok"
    startup_s: float | None = None
    decode_tok_s: float | None = None
    ttft_ms: float | None = None
    throughput: dict[int, float | None] = field(default_factory=dict)
    peak_pss_mib: float | None = None  # the process tree's real peak footprint (see peers/process.py)
    hwm_sum_mib: float | None = None  # sum of each process's VmHWM: an upper bound
    prompt_tokens: float | None = None
    notes: list[str] = field(default_factory=list)
    build_flags: list[str] = field(default_factory=list)  # cmake flags of a peer built here (llama.cpp)
    cpu_busy_before: float | None = None  # how busy the CPUs were (0..1) just before the server started
    cpu_other_during: dict[int, float] = field(default_factory=dict)  # per level: other work's share of the CPUs

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def machine(cpu: Cpu) -> str:
    """CPU model, cores, memory and OS, in one line."""
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return f"{cpu.model}, {cpu.cores} cores, {mem_kib / 2**20:.0f} GiB, {platform.platform()}"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def results_table(rows: list[Row], levels: list[int]) -> str:
    head = ["system", "version", "decode tok/s (1 stream)", "TTFT ms (1 stream)",
            *[f"out tok/s @{c}" for c in levels], "peak memory MiB (PSS)", "sum of VmHWM MiB", "start s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if not row.ok:
            lines.append(f"| {row.label} | {row.version or '-'} | {row.status} |" + " |" * (len(head) - 3))
            continue
        cells = [row.label, row.version, _num(row.decode_tok_s, 1), _num(row.ttft_ms, 0),
                 *[_num(row.throughput.get(c), 0) for c in levels], _num(row.peak_pss_mib, 0),
                 _num(row.hwm_sum_mib, 0), _num(row.startup_s, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: list[Row], levels: list[int], ours_key: str = "core") -> str:
    """One core row's numbers divided by each peer's (above 1: core is faster, or for memory: uses more)."""
    ours = next((r for r in rows if r.key == ours_key and r.ok), None)
    head = ["core / peer", "decode (1 stream)", *[f"out tok/s @{c}" for c in levels], "peak memory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row.key in CORE_KEYS:
            continue
        if ours is None or not row.ok:
            lines.append(f"| {row.label} |" + " - |" * (len(head) - 1))
            continue
        cells = [row.label, _ratio(ours.decode_tok_s, row.decode_tok_s),
                 *[_ratio(ours.throughput.get(c), row.throughput.get(c)) for c in levels],
                 _ratio(ours.peak_pss_mib, row.peak_pss_mib)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_tables(rows: list[Row], levels: list[int]) -> list[str]:
    """A ratio table for each core row (none without core rows or peers), as page lines."""
    if all(row.key in CORE_KEYS for row in rows):
        return []
    parts: list[str] = []
    for ours in (row for row in rows if row.key in CORE_KEYS):
        parts += [f"{ours.label}: its ratio to each peer (core / peer; above 1: core is faster, or for "
                  "memory, uses more):", "", ratio_table(rows, levels, ours.key), ""]
    return parts


def notes(rows: list[Row]) -> str:
    return "\n".join(f"- {row.label}: {note}" for row in rows for note in row.notes)


def markdown(rows: list[Row], levels: list[int], settings: dict, date: str, plot_name: str, cpu: Cpu) -> str:
    """The whole results page (its third line on is the README's section)."""
    parts = [f"# Side-by-side benchmark, {date}", "",
             f"Machine: {machine(cpu)}.", f"{cpu.line()}.", "",
             MODEL_NOTE + " " + ", ".join(f"{k}: {v}" for k, v in settings.items()) + ".", "",
             results_table(rows, levels), "", *ratio_tables(rows, levels),
             f"![throughput against concurrency]({plot_name})", ""]
    if any(row.notes for row in rows):
        parts += ["Notes:", "", notes(rows), ""]
    parts += ["Reproduce: `nox -s bench` (see benchmarks/side_by_side.py).", ""]
    return "\n".join(parts)


def plot(rows: list[Row], levels: list[int], path: Path, title: str) -> str:
    """Output tokens/s against concurrency, one line per system; returns "" or why no plot was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc})"
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        points = [(c, row.throughput[c]) for c in levels if row.ok and row.throughput.get(c)]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=row.label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set(xlabel="concurrent requests", ylabel="output tokens/s", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def write_json(rows: list[Row], settings: dict, path: Path, cpu: Cpu) -> None:
    path.write_text(json.dumps({"machine": machine(cpu), "cpu": asdict(cpu), "settings": settings,
                                "rows": [asdict(r) for r in rows]}, indent=2))


def update_readme(readme: Path, section: str) -> bool:
    """Replace the text between the README's markers with `section`; False if the markers are missing."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return False
    before, rest = text.split(README_START, 1)
    after = rest.split(README_END, 1)[1]
    readme.write_text(f"{before}{README_START}\n{section.strip()}\n{README_END}{after}")
    return True
