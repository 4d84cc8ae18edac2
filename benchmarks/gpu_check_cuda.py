"""GPU check of the cuda backend: benchmarks/gpu_check.py with the hand-written CUDA kernels as one more
op-set column, beside Triton (the pytorch backend's kernels on CUDA). One table.

It joins gpu_check.py through its extension point, ``OP_SETS``: the ``cuda`` column's ops come from
``core_cuda_backend.ops.op_set()``, its native tests are the cuda plugin's ``-m gpu`` tests, and one more row
times the CUDA sampling kernel against the torch sampler. So every row of gpu_check (kernel tests, parity,
per-kernel time and achieved bandwidth at Llama-3-8B shapes, end-to-end decode tok/s of an 8B-shaped
random model at batch 1, 32 and 128, eager and with CUDA graphs) gets a ``cuda`` value; the ``triton``
column is the pytorch backend. The plain-torch ``reference`` column is left out unless --with-reference
(it is slow at 8B and not what this check compares). Budget: under 8 minutes on an H200.

    python benchmarks/gpu_check_cuda.py                   # on a CUDA machine with nvcc
    python benchmarks/gpu_check_cuda.py --with-reference  # all three columns

Without a GPU it prints one line and exits 1.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
CUDA_TESTS = ["plugins/cuda_backend/tests/test_kernels_gpu.py", "plugins/cuda_backend/tests/test_backend_gpu.py"]
SAMPLE = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}


def load_gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def add_cuda_column(check: ModuleType, with_reference: bool) -> None:
    """Register the ``cuda`` op set in gpu_check's OP_SETS and teach its ``select`` to build it."""
    if not with_reference:
        check.OP_SETS.pop("reference", None)
    check.OP_SETS["cuda"] = {"kind": "cuda", "kernel_tests": CUDA_TESTS}
    generic_select = check.select

    def select(name: str, device: torch.device):
        if name == "cuda":
            from core_cuda_backend.ops import op_set

            return op_set()
        return generic_select(name, device)

    check.select = select
    torch_sampler = check.sampler_timing

    def sampler_timing(table, s, device) -> None:
        torch_sampler(table, s, device)
        table.add(*cuda_sampling_row(check, s, device))

    check.sampler_timing = sampler_timing


def cuda_sampling_row(check: ModuleType, s, device: torch.device) -> tuple[str, dict[str, str]]:
    """The CUDA sampling kernel on the sampler row's workload: Exp(1) noise drawn by torch + the kernel."""
    from core_cuda_backend.ops import sample_tokens

    batch = max(s.e2e_batches)
    logits = torch.randn(batch, s.vocab, device=device)
    temperature = torch.full((batch,), SAMPLE["temperature"], device=device)
    top_k = torch.full((batch,), SAMPLE["top_k"], dtype=torch.int64, device=device)
    omp = torch.full((batch,), 1.0 - SAMPLE["top_p"], device=device)
    noise = torch.empty_like(logits)

    def step() -> None:
        noise.exponential_()
        sample_tokens(logits, temperature, top_k, omp, None, noise)

    ms = check.time_ms(step, device)
    bytes_moved = 3 * logits.numel() * 4  # logits + noise read, noise written
    return (f"sampling kernel top-k/top-p B={batch} V={s.vocab} (noise + kernel)",
            {"cuda": f"{ms:.3f} ms, {bytes_moved / ms / 1e9:.2f} TB/s"})


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check_cuda: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was checked")
        return 1
    check = load_gpu_check()
    add_cuda_column(check, with_reference="--with-reference" in sys.argv[1:])
    sys.argv = [sys.argv[0]]  # gpu_check's own parser: no --cpu-dry-run here (the CUDA kernels need a GPU)
    return check.main()


if __name__ == "__main__":
    sys.exit(main())
