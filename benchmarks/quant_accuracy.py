"""How closely the quantized paths follow the dequantized float32 model on the same weights (issue 14).

    python benchmarks/quant_accuracy.py [--tokens 2000] [--chunk 256] [--only NAME ...] [--model GGUF]
        [--rows prompt|generated]

The default model (or ``--model``), teacher-forced over ``--tokens`` tokens of the Python documentation's
help topics (``plugins/pytorch_backend/tests/quality.py``) through the backend's paged KV cache. The
oracle is ``load_checkpoint(gguf, dtype="float32", quantization="none")``; each candidate's row gives its
top-1 agreement with the oracle, its perplexity and the ratio to the oracle's, its load and scoring time,
and the bytes its parameters and buffers hold. The candidates are those of
``tests/test_quant_accuracy.py`` (``gguf-packed``, ``int8``, ``int4``) plus ``bf16``: the dense model in
bfloat16, a yardstick for any path that multiplies in bfloat16. ``float32`` (the oracle against itself)
is the first row. Nothing is asserted; the test holds the thresholds (agreement >= 0.965, ratio within 1%).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

QUALITY = Path(__file__).resolve().parents[1] / "plugins" / "pytorch_backend" / "tests" / "quality.py"
CANDIDATES = ("gguf-packed", "int8", "int4", "bf16")


def load_quality():
    name = "core_pytorch_backend_tests_quality"
    spec = importlib.util.spec_from_file_location(name, QUALITY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def candidate_loads(gguf: Path) -> dict:
    """name -> (description, function loading it)."""
    from core_pytorch_backend.loader import cached_gguf_folder, load_checkpoint

    folder = cached_gguf_folder(gguf)
    return {
        "float32": ("dequantized, float32 (oracle)",
                    lambda: load_checkpoint(gguf, dtype="float32", quantization="none")),
        "gguf-packed": ("load_checkpoint(gguf)", lambda: load_checkpoint(gguf)),
        "int8": ("float32 folder, quantization=int8", lambda: load_checkpoint(folder, quantization="int8")),
        "int4": ("float32 folder, quantization=int4", lambda: load_checkpoint(folder, quantization="int4")),
        "bf16": ("dequantized, bfloat16",
                 lambda: load_checkpoint(gguf, dtype="bfloat16", quantization="none")),
    }


def measure(gguf: Path, names: list[str], tokens: int, chunk: int, prompt: bool = True) -> list[tuple]:
    """(name, description, weights, dtype, agreement, ppl, ppl ratio, load s, score s, weights MiB) of the
    float32 oracle and each candidate in ``names``, teacher-forced over ``tokens`` positions (``prompt``: their
    rows marked as a prompt's tokens)."""
    quality = load_quality()
    loads = candidate_loads(gguf)
    rows = []
    oracle = reference = None
    for name in ("float32", *names):
        description, load = loads[name]
        start = time.perf_counter()
        loaded = load()
        load_s = time.perf_counter() - start
        if reference is None:
            reference = quality.reference_tokens(loaded.tokenizer, tokens)
        run = quality.teacher_forced(loaded, reference, chunk=chunk, prompt=prompt)
        oracle = oracle or run
        result = quality.compare(run, oracle)
        rows.append((name, description, loaded.quantization, str(loaded.dtype).replace("torch.", ""),
                     result.agreement, result.perplexity, result.perplexity_ratio, load_s, run.seconds,
                     quality.weight_bytes(loaded.model) / 2**20))
        print(f"{name}: {result} ({run.seconds:.1f} s)", file=sys.stderr, flush=True)
        del loaded
        gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="positions scored (default 2000)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk in tokens (default 256)")
    parser.add_argument("--only", nargs="+", choices=CANDIDATES, default=list(CANDIDATES),
                        help="candidates to run (default: all)")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--rows", choices=["prompt", "generated"], default="prompt",
                        help="score the rows as a prompt's tokens (the packed matmuls' prompt loop where the CPU "
                             "has one: native/tile_rows.py) or as generated tokens (the VNNI loop); default prompt")
    args = parser.parse_args()

    from core_pytorch_backend.loader import default_model_path

    gguf = args.model or default_model_path()
    rows = measure(gguf, args.only, args.tokens, args.chunk, args.rows == "prompt")

    print(f"\n{gguf.name}, {args.tokens} positions of the Python help topics, prefill chunks of {args.chunk}, "
          f"scored as {args.rows} tokens' rows\n")
    header = ("candidate", "load", "weights", "dtype", "agreement", "ppl", "ppl ratio", "load s", "score s",
              "weights MiB")
    table = [header] + [(n, d, w, dt, f"{a:.4f}", f"{p:.4f}", f"{r:.4f}", f"{ls:.1f}", f"{ss:.1f}",
                         f"{mb:.0f}") for n, d, w, dt, a, p, r, ls, ss, mb in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
