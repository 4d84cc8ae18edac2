"""--kv-cache-dtype int8 (kernels/kv_int8.py): the rows' codes, the cache's shape and budget, and an engine
serving from such a cache through batching, chunked prefill, prefix caching, preemption, n > 1 and sleep.

The kernels' side (store bit for bit, decode and chunk attention against the reference, the native decode
stack's bits) is in test_native_kernels.py and test_native_decode.py; agreement with the float32 model on
real text in test_quant_accuracy.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import InvalidRequestError
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend, PytorchOptions
from core_pytorch_backend.kernels import kv_int8
from core_pytorch_backend.model_runner import kv_bytes_per_block

INT8 = {"kv_cache_dtype": "int8"}
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def make_backend(path, **options) -> PytorchBackend:
    return PytorchBackend(EngineConfig(model=str(path), **{"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}))


def prompts_of_different_lengths(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 37)] for i in range(count)]


async def generate_all(engine: AsyncEngine, prompts, config=GREEDY):
    return await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))


def test_a_row_keeps_its_values_within_half_a_step():
    x = torch.randn(5, 3, 64) * torch.tensor([0.1, 1.0, 30.0])[None, :, None]
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, 64 + kv_int8.ROW_EXTRA)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255
    error = (kv_int8.dequantize(rows) - x).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 1e-6).all()
    assert (kv_int8.dequantize(rows).amin(-1) == x.amin(-1)).all()  # the minimum is kept exactly (code 0)


def test_a_row_of_equal_values_and_a_zeroed_row_read_back_exactly():
    x = torch.full((2, 16), -0.75)
    rows = kv_int8.quantize(x)
    assert (rows[:, :16] == 0).all() and torch.equal(kv_int8.dequantize(rows), x)
    assert torch.equal(kv_int8.dequantize(torch.zeros(4, 16 + kv_int8.ROW_EXTRA, dtype=torch.uint8)), torch.zeros(4, 16))


async def test_the_cache_holds_more_blocks_in_the_same_budget(tiny_checkpoint_factory):
    backend = make_backend(tiny_checkpoint_factory("llama"), dtype="float32", backend_options=INT8)
    try:
        runner = backend.loop.runner
        per_float = kv_bytes_per_block(runner.model, 16, torch.float32)
        per_int8 = kv_bytes_per_block(runner.model, 16, kv_int8.DTYPE)
        head_dim = runner.model.config.hidden_size // runner.model.config.num_attention_heads
        assert per_float / per_int8 == (4 * head_dim) / (head_dim + kv_int8.ROW_EXTRA)
        k_cache, v_cache = runner.kv_caches[0]
        assert k_cache.dtype == v_cache.dtype == kv_int8.DTYPE and k_cache.shape[-1] == head_dim + kv_int8.ROW_EXTRA
        assert runner.num_blocks == int(0.01 * 2**30 // per_int8)
    finally:
        await backend.close()


async def test_an_engine_over_an_int8_cache_serves_consistently(tiny_checkpoint_factory):
    """Its own greedy outputs hold whatever the batch, the chunking, the prefix cache, a tight cache that
    preempts, n > 1 (a block copy) and sleep cycles; and every block comes back."""
    path = tiny_checkpoint_factory("llama")
    prompts = prompts_of_different_lengths(12)
    config = GREEDY
    engine = AsyncEngine(make_backend(path, backend_options=INT8))
    chunked = AsyncEngine(make_backend(path, backend_options=INT8, max_num_batched_tokens=16,
                                       enable_prefix_caching=False))
    # 2 layers x 2 kv heads x (16 + 8) bytes x 16 tokens x 2: 3 KiB a block; 10 blocks hold ~3 requests
    tight = AsyncEngine(make_backend(path, backend_options=INT8, kv_cache_memory_gib=10 * 3072 / 2**30,
                                     max_model_len=160))
    try:
        alone = [(await collect(engine.generate(p, config))).token_ids for p in prompts]
        assert [r.token_ids for r in await generate_all(engine, prompts, config)] == alone  # batched, prefix-cached
        assert [r.token_ids for r in await generate_all(chunked, prompts, config)] == alone
        assert [r.token_ids for r in await generate_all(tight, prompts, config)] == alone
        assert tight.stats().kv_blocks_total == 10
        forked = await collect(engine.generate(prompts[3], config.replace(n=2)))
        assert [c.token_ids for c in forked.choices] == [alone[3]] * 2
        await engine.sleep(1)
        await engine.wakeup(["weights"])
        await engine.wakeup(["kv_cache"])
        assert (await collect(engine.generate(prompts[0], config))).token_ids == alone[0]
        for each in (engine, chunked, tight):
            assert_idle(each, await wait_idle(each))
    finally:
        for each in (engine, chunked, tight):
            await each.close()


def test_the_option_is_validated_and_kept_to_the_cpu():
    assert PytorchOptions().kv_cache_dtype == "auto" and PytorchOptions.from_mapping(INT8).kv_cache_dtype == "int8"
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'") as error:
        PytorchOptions.from_mapping({"kv_cache_dtype": "fp8"})
    assert error.value.param == "backend_options.kv_cache_dtype"
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype int8 runs on the CPU only") as error:
        PytorchBackend(EngineConfig(model="unused", device="cuda", backend_options=INT8))
    assert error.value.param == "backend_options.kv_cache_dtype"
