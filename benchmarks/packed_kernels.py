"""The packed-weight kernels alone: the native C kernel (each variant this CPU runs) against torch's int4 kernel.

    python benchmarks/packed_kernels.py [--rows 1 4 16 64] [--threads 1] [--variants avx512-vnni avx2]

SmolLM2-135M's matmul shapes (the fused q/k/v, o, gate/up and down projections as 4-bit codes, the
LM head as 8-bit codes), random weights quantized per 32 inputs. Per shape and number of activation rows
it prints the best-of-trials microseconds of a call and, for the native kernel, the int8 multiply-adds
per second it reaches (two per weight and row: the activations' two int8 steps); where the kernels have
AMX tiles, also the VNNI loop without its exact int8 tiles (from 16 rows: the same bits, on vectors alone),
and the bfloat16 tile loop's time and FLOP/s (two a weight and row; at 1-2 rows its vector twin, the same bits,
and then the tiles alone). torch's kernel runs on
bfloat16 activations with its own dispatch (set ATEN_CPU_CAPABILITY=avx2 to see its AVX2 path). The
weights stay hot in the caches between calls, unlike in a decode step, where the 4-bit layers stream
from memory: this measures the arithmetic, `decode_step.py` the step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

SHAPES = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8)]
TRIALS = 7


def best_us(call, budget_s: float = 0.05) -> float:
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    repeats = max(1, int(budget_s / max(once, 1e-6) / TRIALS))
    best = float("inf")
    for _ in range(TRIALS):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def main() -> None:
    from core_pytorch_backend.layers.quantized import Int4Weight
    from core_pytorch_backend.native import build
    from core_pytorch_backend.native.library import load
    from core_pytorch_backend.native.packed_weight import NativeWeight
    from core_pytorch_backend.quant.affine import quantize_int4, quantize_int8

    runnable = [v for v, needed in build.VARIANT_CPU_FLAGS.items() if needed <= build.cpu_flags() and v != "generic"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=runnable, choices=runnable)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# packed kernels, {args.threads} thread(s), torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, native variants: {', '.join(args.variants)}")
    for n, k, bits in SHAPES:
        dense = np.random.default_rng(n * k).standard_normal((n, k)).astype(np.float32) * 0.05
        codes = quantize_int4(dense) if bits == 4 else quantize_int8(dense)
        torch_weight = Int4Weight.from_affine(codes, torch.bfloat16)
        natives = {v: NativeWeight.from_affine(codes, load(v)) for v in args.variants}
        for m in args.rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            torch_us = best_us(lambda w=torch_weight, xb=xb: w.linear(xb, None))
            cells = [f"torch int4 bf16 {torch_us:8.1f} us"]
            for variant, weight in natives.items():
                us = best_us(lambda w=weight, x=x: w.linear(x, None))
                cells.append(f"{variant} {us:8.1f} us ({2 * n * k * m / us / 1e3:6.1f} G int8-MAC/s)")
                if weight.kernels.exact_tiles() and m >= 16:  # the same call on the vector loop alone
                    weight.kernels.exact_tiles(False)
                    us = best_us(lambda w=weight, x=x: w.linear(x, None))
                    weight.kernels.exact_tiles(True)
                    cells.append(f"{variant} vector loop alone {us:8.1f} us")
                if weight.kernels.uses_amx:  # the AMX tile loop (a prompt's rows: native/tile_rows.py)
                    us = best_us(lambda w=weight, x=x: w.linear(x, None, tiles=True))
                    cells.append(f"{variant} tiles {us:8.1f} us ({2 * n * k * m / us / 1e3:6.1f} G bf16-FLOP/s)")
                    if m <= 2 and weight.kernels.tile_twin():  # that was the tiles' vector twin: the tiles alone
                        weight.kernels.tile_twin(False)
                        us = best_us(lambda w=weight, x=x: w.linear(x, None, tiles=True))
                        weight.kernels.tile_twin(True)
                        cells.append(f"{variant} tiles without the twin {us:8.1f} us")
            print(f"{n:>5}x{k:<5} {bits}-bit rows {m:>3}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
