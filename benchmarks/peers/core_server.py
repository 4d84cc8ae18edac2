"""`core serve` on the default GGUF file, from the benchmark's own environment, in two rows: with no
flags (exactly what a user gets) and with the harness's `--core-best-args` (core's fastest configuration).

Only the address and the model name clients send are added; `OMP_NUM_THREADS` is the harness's
`--threads`, as every peer gets its thread count; under the run's ISA ceiling (`--isa-ceiling avx2`)
`CORE_CPU_KERNELS`, `ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA` and `MKL_ENABLE_INSTRUCTIONS` hold core's
kernels and torch's to it. Before the timed start the row's own server is started once and stopped when
ready, as a user's earlier start would have: the start-up target is "with a warm cache" (the native
kernels built for this CPU, the GGUF metadata converted, the kept config and tokenizer class and the
tensor-name map written under ~/.cache/core, and for a dense row the dequantized weights), and the first
start on a fresh machine does all that.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from peers.cpu import this_cpu
from peers.peer import Context, Launch
from peers.process import PeerProcess

QUANT_NAME = re.compile(r"(?:^|[.\-_])((?:I?Q\d[\w]*)|F16|F32|BF16)$", re.IGNORECASE)


def gguf_kind(gguf: Path) -> str:
    """"Q4_1 GGUF" for SmolLM2-135M-Instruct.Q4_1.gguf, "Q4_K_M GGUF" for Model-1.7B-Q4_K_M.gguf (the
    quantization type that ends the file name), else "GGUF"."""
    found = QUANT_NAME.search(gguf.stem)
    return f"{found.group(1).upper()} GGUF" if found else "GGUF"


def label(gguf: Path, extra: Sequence[str]) -> str:
    """The row's name, saying what it served and how: `core serve Q4_1 GGUF (no flags)`."""
    return f"core serve {gguf_kind(gguf)} " + (shlex.join(extra) if extra else "(no flags)")


def command(ctx: Context, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "core.cli", "serve", str(ctx.gguf), *extra, "--host", "127.0.0.1",
            "--port", str(ctx.port), "--served-model-name", "smollm2"]


def warm_cache(launch: Launch, url: str) -> None:
    """Start the row's own server once and stop it as soon as `url` answers: the caches its timed start
    reads are then there, whatever its flags load (a dense row also converts the GGUF's weights)."""
    process = PeerProcess("core-warm-up", launch.command, launch.env).start()
    try:
        process.wait_ready(url, launch.start_timeout_s)
    finally:
        process.stop()


def ceiling_env() -> dict[str, str]:
    """Under the run's ISA ceiling, the variables that hold core's native kernels and torch's to it: ATen's
    own kernels, and the oneDNN and MKL GEMMs torch calls (each dispatches on the CPU by itself)."""
    ceiling = this_cpu(with_torch=False).ceiling
    if not ceiling:
        return {}
    return {"CORE_CPU_KERNELS": ceiling, "ATEN_CPU_CAPABILITY": ceiling, "ONEDNN_MAX_CPU_ISA": ceiling.upper(),
            "MKL_ENABLE_INSTRUCTIONS": ceiling.upper()}


def launcher(extra: Sequence[str] = ()) -> Callable[[Context], Launch]:
    """The launch function of the row that adds `extra` to `core serve GGUF`."""
    def launch(ctx: Context) -> Launch:
        ready = Launch(command(ctx, extra), model="smollm2",
                       version=f"core-serve {importlib.metadata.version('core-serve')}",
                       env={"OMP_NUM_THREADS": str(ctx.threads), **ceiling_env()}, start_timeout_s=180.0)
        warm_cache(ready, f"http://127.0.0.1:{ctx.port}{ready.ready_path}")
        return ready
    return launch
