"""How the model's linear layers multiply: plain ``F.linear``, or float32 GEMMs on half-precision weights.

On a CPU without half-precision matrix instructions (no AVX-512-BF16 / AMX: oneDNN reports no bf16
support), PyTorch's bf16 and fp16 GEMMs fall back to a generic path that is 5-20x slower than float32
sgemm once a step has more than a few rows. ``UpcastMatmul`` keeps the weights in half precision (the
memory a user asked for) and, for steps of ``min_rows`` rows or more, copies each weight into one reused
float32 scratch buffer, multiplies in float32 and rounds the output back: the numbers a native bf16 GEMM
gives (half-precision inputs, float32 accumulation), at sgemm speed. Single-row decode keeps the native
matrix-vector path, which is memory-bound and fast in half precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
HALF_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_MIN_ROWS = 4


class UpcastMatmul:
    """``F.linear`` computed in float32 for half-precision weights, through one shared scratch buffer.

    One instance serves every layer of one model (layers run one after another on the engine thread);
    the buffer holds the largest weight once, so no step allocates a float32 copy of the model.
    """

    def __init__(self, max_weight_numel: int, min_rows: int = DEFAULT_MIN_ROWS) -> None:
        if min_rows < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        self.min_rows = min_rows
        self.scratch = torch.empty(max_weight_numel, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows < self.min_rows:
            return F.linear(x, weight, bias)
        w32 = self.scratch[: weight.numel()].view(weight.shape).copy_(weight)
        b32 = bias.float() if bias is not None else None
        return F.linear(x.float(), w32, b32).to(x.dtype)


def cpu_has_native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` GEMMs with native instructions on this CPU."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def select_matmul(model: nn.Module, device: torch.device, dtype: torch.dtype) -> Matmul | None:
    """The matmul a model on ``device`` in ``dtype`` should use; None means plain ``F.linear``."""
    if device.type != "cpu" or dtype not in HALF_DTYPES or cpu_has_native_half_matmul(dtype):
        return None
    largest = max((m.weight.numel() for m in _matmul_layers(model)), default=0)
    return UpcastMatmul(largest) if largest else None


def use_matmul(model: nn.Module, matmul: Matmul | None) -> None:
    """Route every linear layer and the LM head of ``model`` through ``matmul`` (None: ``F.linear``)."""
    for layer in _matmul_layers(model):
        layer.matmul = matmul or F.linear


def _matmul_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "matmul")]
