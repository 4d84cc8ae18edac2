"""One linear layer's cost per kernel and row count on this CPU: the measurements behind the packed path.

    python benchmarks/packed_matmul.py [--rows 1 8 64] [--threads 2]

For SmolLM2-135M's shapes (q/k/v fused, o, gate/up fused, down, the LM head) it times dense float32 and
bfloat16 ``F.linear``, torch's int8 weight-only kernel (bf16 activations, per-channel scales) and its int4
kernel in bf16 and float32 activations (4-bit codes per 32 inputs; also as two 4-bit planes, how core
keeps 8-bit codes such as GGUF's Q8_0), in microseconds per call (best of several trials). Numbers
only: what `quant/kernel_choice.py` decides at start-up is the int4 kernel's dtype.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from core_pytorch_backend.layers.quantized import Int4Weight
from core_pytorch_backend.quant.affine import AffineWeight, quantize_int4

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def best_us(fn, trials: int = 5, calls: int = 10) -> float:
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def kernels(weight: np.ndarray):
    dense = torch.from_numpy(weight)
    dense16 = dense.bfloat16()
    scale = torch.from_numpy(np.abs(weight).max(-1) / 127)  # per-channel int8: torch's other kernel
    codes8 = torch.round(dense / scale[:, None]).to(torch.int8)
    scale16 = scale.bfloat16()
    codes = quantize_int4(weight)
    two_planes = AffineWeight(codes.q * 17, codes.scale / 17, codes.offset, 8, 32)  # an 8-bit code, same w
    return {
        "dense f32": lambda x: F.linear(x, dense),
        "dense bf16": lambda x: F.linear(x.bfloat16(), dense16),
        "per-channel int8 bf16": lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes8, scale16),
        "int4 bf16": (lambda w: lambda x: w.linear(x, None))(Int4Weight.from_affine(codes, torch.bfloat16)),
        "int4 f32": (lambda w: lambda x: w.linear(x, None))(Int4Weight.from_affine(codes, torch.float32)),
        "8-bit as 2 int4 planes bf16": (lambda w: lambda x: w.linear(x, None))(
            Int4Weight.from_affine(two_planes, torch.bfloat16)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# us per call, {args.threads} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    rng = np.random.default_rng(0)
    for label, shape in SHAPES.items():
        weight = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        table = kernels(weight)
        for rows in args.rows:
            x = torch.randn(rows, shape[1])
            cells = ", ".join(f"{name} {best_us(lambda f=fn, x=x: f(x)):,.0f}" for name, fn in table.items())
            print(f"{label} @ {rows} rows: {cells}")


if __name__ == "__main__":
    main()
