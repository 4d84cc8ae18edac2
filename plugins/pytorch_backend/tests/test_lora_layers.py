"""The LoRA term of one layer (lora/layers.py) against a row-by-row reference: the native kernel
(csrc/lora.c) and the torch paths (one adapter, masked, grouped), float32 and bfloat16 slots, fused
layers, ranks below the maximum and base rows; the native kernel's rows do not depend on their batch."""

from __future__ import annotations

import pytest
import torch

from core_pytorch_backend.lora import layers as lora_layers
from core_pytorch_backend.lora.layers import LoraLayer, LoraStep
from core_pytorch_backend.native import build
from core_pytorch_backend.native.library import available, load

CPU = torch.device("cpu")
SLOTS, MAX_RANK, IN = 3, 8, 40
OUTPUTS = [24, 8, 8]  # a fused q/k/v-like layer
RANKS = [8, 3, 5]
NATIVE = available()
# every variant this CPU runs (generic, avx2, avx512-vnni, avx512-bf16, amx-bf16): an AVX2-only machine runs the avx2 one
VARIANTS = [v for v, needed in build.VARIANT_CPU_FLAGS.items() if needed <= build.cpu_flags()] if NATIVE else []


def make_layer(native: bool | str, dtype: torch.dtype, outputs=OUTPUTS) -> tuple[LoraLayer, dict]:
    """native: False (the torch paths), True (this CPU's best kernels) or a variant's name."""
    step = LoraStep(dtype, native=bool(native))
    kernels = (load(native) if isinstance(native, str) else NATIVE) if native else None
    layer = LoraLayer(step, SLOTS, MAX_RANK, IN, outputs, CPU, dtype, kernels)
    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for slot, rank in enumerate(RANKS):
        shards = {j: (torch.randn(rank, IN, generator=generator), torch.randn(size, rank, generator=generator))
                  for j, size in enumerate(outputs) if (slot + j) % 3 != 2 or len(outputs) == 1}  # some shards absent
        layer.load(slot, shards)
        adapters[slot] = shards
    return layer, adapters


def reference(x, y, row_slots, adapters, outputs, dtype):
    """y + per row: for each shard its (x A^T) B^T in its output columns, with the weights rounded to dtype."""
    out = y.clone().double()
    starts = [sum(outputs[:j]) for j in range(len(outputs))]
    for i, slot in enumerate(row_slots):
        if slot < 0:
            continue
        for j, (a, b) in adapters[slot].items():
            a, b = a.to(dtype).double(), b.to(dtype).double()
            out[i, starts[j] : starts[j] + outputs[j]] += b @ (a @ x[i].double())
    return out


ROWS = {
    "one adapter": [1] * 6,
    "decode mix": [0, -1, 2, 1, 2, 0],
    "prefill mix": [i % 4 - 1 for i in range(40)],  # more rows than MASKED_ROWS: grouped
    "one row": [2],
    "base only": [-1, -1],
}


@pytest.mark.parametrize("native", [*VARIANTS, False], ids=[*VARIANTS, "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs", [OUTPUTS, [16]], ids=["fused", "plain"])
@pytest.mark.parametrize("case", list(ROWS))
def test_lora_term_matches_row_by_row_reference(native, dtype, outputs, case):
    layer, adapters = make_layer(native, dtype, outputs)
    row_slots = ROWS[case]
    x, y = torch.randn(len(row_slots), IN), torch.randn(len(row_slots), sum(outputs))
    expected = reference(x, y, row_slots, adapters, outputs, dtype)
    layer.step.set_rows(row_slots, CPU)
    got = layer(x, y.clone())
    tolerance = 1e-4 if dtype == torch.float32 or native else 0.15  # the torch path multiplies in bfloat16
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_masked_path_is_the_one_small_mixed_steps_take():
    step = LoraStep()
    step.set_rows([0, -1, 2], CPU)
    assert step.mask is not None and step.mask.shape == (3, 3) and not step.groups
    step.set_rows([0, 1] * lora_layers.MASKED_ROWS, CPU)
    assert step.mask is None and [slot for slot, _ in step.groups] == [0, 1]
    step.set_rows([1, 1], CPU)
    assert step.single == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_rows_do_not_depend_on_their_batch(variant):
    layer, _ = make_layer(variant, torch.float32)
    x = torch.randn(9, IN)
    row_slots = [0, 1, 2, 0, 0, 1, -1, 2, 0]
    layer.step.set_rows(row_slots, CPU)
    together = layer(x, torch.zeros(9, sum(OUTPUTS)))
    for i, slot in enumerate(row_slots):
        layer.step.set_rows([slot], CPU)
        alone = layer(x[i : i + 1], torch.zeros(1, sum(OUTPUTS)))
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native kernels are unavailable")
def test_native_kernel_refuses_a_slot_out_of_range():
    from core_pytorch_backend.native.library import CpuKernelError

    layer, _ = make_layer(True, torch.float32)
    layer.step.set_rows([0], CPU)
    layer.step.row_slots = torch.tensor([SLOTS], dtype=torch.int32)
    with pytest.raises(CpuKernelError, match="core_lora_apply: bad arguments"):
        layer(torch.randn(1, IN), torch.zeros(1, sum(OUTPUTS)))


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None, reason="no C compiler: the native kernels are unavailable")), False], ids=["native", "torch"])
def test_a_call_of_other_rows_than_the_steps_gets_no_adapter(native):
    """A layer called on rows that are not the step's (a vision tower encoding on its own thread while a
    step runs) is left alone, not read past the step's slots."""
    layer, _ = make_layer(native, torch.float32)
    layer.step.set_rows([0, 1, 2], CPU)
    y = torch.randn(5, sum(OUTPUTS))
    assert torch.equal(layer(torch.randn(5, IN), y.clone()), y)
    layer.step.clear()
    assert torch.equal(layer(torch.randn(3, IN), y[:3].clone()), y[:3])


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_native_kernel_refuses_other_than_float32_rows(variant):
    layer, _ = make_layer(variant, torch.float32)
    layer.step.set_rows([0, 1], CPU)
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(2, IN, dtype=torch.bfloat16), torch.zeros(2, sum(OUTPUTS), dtype=torch.bfloat16))


@pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native kernels are unavailable")
def test_ranks_above_the_native_kernels_maximum_take_the_torch_ops():
    from core.adapters import AdapterPolicy
    from core_pytorch_backend.lora.manager import _native_for

    largest = NATIVE.function("core_lora_max_rank")()
    assert _native_for(AdapterPolicy(max_lora_rank=largest), CPU, torch.float32) is NATIVE
    assert _native_for(AdapterPolicy(max_lora_rank=largest + 1), CPU, torch.float32) is None
    assert _native_for(AdapterPolicy(max_lora_rank=16), CPU, torch.bfloat16) is None
