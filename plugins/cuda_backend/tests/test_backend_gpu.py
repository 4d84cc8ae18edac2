"""The cuda backend end to end on a GPU (skipped elsewhere, with the reason): greedy parity with
transformers under continuous batching and chunked prefill, decode through CUDA graphs, sleep/wakeup
with the graphs recaptured for the new KV cache, and the core's backend contract suite."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.testing.contract import BackendContractTests, assert_idle, wait_idle
from core_cuda_backend.availability import unavailable_reason

REASON = "no CUDA GPU: torch.cuda.is_available() is False" if not torch.cuda.is_available() else unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def make_backend(path, **options):
    from core_cuda_backend.backend import CudaBackend

    options = {"dtype": "float32", "kv_cache_memory_gib": 0.05, "max_num_seqs": 16, **options}
    return CudaBackend(EngineConfig(model=str(path), **options))


def reference_greedy(path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate on the same weights (CPU, float32), eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def prompts_of_different_lengths(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 37)] for i in range(count)]


async def test_greedy_parity_with_transformers_single_and_concurrent(tiny_llama_64):
    backend = make_backend(tiny_llama_64, max_num_batched_tokens=64)  # chunked prefill over cached prefixes
    assert backend.loop.runner.model.ops.name == "cuda"
    assert backend.loop.runner.decode_path is not None  # decode steps replay captured graphs
    engine = AsyncEngine(backend)
    try:
        prompts = prompts_of_different_lengths(16)
        want = reference_greedy(tiny_llama_64, prompts, 12)
        assert (await collect(engine.generate(prompts[5], GREEDY))).token_ids == want[5]
        together = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in prompts))
        assert [r.token_ids for r in together] == want
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_bfloat16_decodes_like_float32_on_most_tokens(tiny_llama_64):
    prompts = prompts_of_different_lengths(4)
    results = {}
    for dtype in ("float32", "bfloat16"):
        engine = AsyncEngine(make_backend(tiny_llama_64, dtype=dtype))
        try:
            results[dtype] = [(await collect(engine.generate(p, GREEDY))).token_ids for p in prompts]
        finally:
            await engine.close()
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(results["float32"], results["bfloat16"], strict=True))
    assert first_tokens_equal >= 3  # random weights: bf16 may flip a near tie, not most first tokens


async def test_sleep_wakeup_recaptures_graphs_and_keeps_outputs(tiny_llama_64):
    backend = make_backend(tiny_llama_64)
    engine = AsyncEngine(backend)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    try:
        before = (await collect(engine.generate(prompt, GREEDY))).token_ids
        for level in (1, 2, 1):
            await engine.sleep(level)
            assert not backend.loop.runner.decode_path.graphs  # released with the KV cache
            await engine.wakeup(["weights"])
            await engine.wakeup(["kv_cache"])
            assert backend.loop.runner.decode_path.graphs  # captured again for the new cache
            assert (await collect(engine.generate(prompt, GREEDY))).token_ids == before
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


class TestCudaBackendContract(BackendContractTests):
    @pytest.fixture
    async def backend(self, tiny_llama_64):
        backend = make_backend(tiny_llama_64)
        yield backend
        await backend.close()
