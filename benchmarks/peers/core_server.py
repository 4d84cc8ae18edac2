"""`core serve` on the default model in bfloat16, from the benchmark's own environment."""

from __future__ import annotations

import importlib.metadata
import sys

from peers.peer import Context, Launch


def launch(ctx: Context) -> Launch:
    command = [sys.executable, "-m", "core.cli", "serve", "--dtype", "bfloat16", "--host", "127.0.0.1",
               "--port", str(ctx.port), "--served-model-name", "smollm2",
               "--max-num-seqs", str(max(64, ctx.max_concurrency))]
    return Launch(command, model="smollm2", version=f"core-serve {importlib.metadata.version('core-serve')}",
                  env={"OMP_NUM_THREADS": str(ctx.threads)}, start_timeout_s=180.0)
