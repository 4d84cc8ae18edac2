"""How the model's linear layers multiply: plain ``F.linear``, or float32 GEMMs on half-precision weights.

On a CPU without half-precision matrix instructions (no AVX-512-BF16 / AMX: oneDNN reports no bf16
support), PyTorch's bf16 and fp16 GEMMs fall back to a generic path that is 5-20x slower than float32
sgemm once a step has more than a few rows. ``UpcastMatmul`` keeps the weights in half precision (the
memory a user asked for) and, for steps of ``min_rows`` rows or more, copies each weight, a slice of
output rows at a time, into one small reused float32 scratch buffer (small enough to stay in cache: the
conversion of a large weight such as the LM head is memory-bound otherwise), multiplies in float32 and
rounds the output back: the numbers a native bf16 GEMM gives (half-precision inputs, float32
accumulation), at sgemm speed. Decode steps of a few rows keep the native matrix-vector path, which is
memory-bound and faster in half precision.

Measured on this project's 2-core AVX2 CI machine (bf16, 2 threads, microseconds; native / upcast):
SmolLM2's gate_up weight 3072x576 at 1 row 183 / 394, 8 rows 1,474 / 879, 32 rows 5,977 / 1,510; its
LM head 49152x576 at 8 rows 25,034 / 13,977, 32 rows 95,945 / 21,975.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
HALF_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_MIN_ROWS = 6  # below it the native path is as fast or faster (break-even at 4-5 rows)
CHUNK_ELEMENTS = 1 << 20  # 4 MiB of float32 scratch


class UpcastMatmul:
    """``F.linear`` computed in float32 for half-precision weights, through one shared scratch buffer.

    One instance serves every layer of one model (layers run one after another on the engine thread);
    the buffer holds ``chunk_elements`` floats, so no step allocates a float32 copy of a weight.
    """

    def __init__(self, max_weight_numel: int, min_rows: int = DEFAULT_MIN_ROWS,
                 chunk_elements: int = CHUNK_ELEMENTS) -> None:
        if min_rows < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
        self.min_rows = min_rows
        self.scratch = torch.empty(min(max_weight_numel, chunk_elements), dtype=torch.float32)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows < self.min_rows:
            return F.linear(x, weight, bias)
        x32 = x.float()
        if self.scratch.numel() < weight.shape[1]:  # a slice holds at least one output row
            self.scratch = torch.empty(weight.shape[1], dtype=torch.float32)
        step = self.scratch.numel() // weight.shape[1]  # output rows per slice
        pieces = []
        for start in range(0, weight.shape[0], step):
            part = weight[start : start + step]
            pieces.append(F.linear(x32, self.scratch[: part.numel()].view(part.shape).copy_(part)))
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)


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
    """Layers that multiply by a dense weight (packed ones keep their own kernels)."""
    return [m for m in model.modules() if hasattr(m, "matmul") and isinstance(m.weight, torch.Tensor)]
