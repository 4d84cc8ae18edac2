"""The default model served as it is (its Q4_1 GGUF packed, the native kernels): a request's greedy tokens and
their logprobs are the same whatever runs beside it. Twenty requests at once make decode steps of 16 rows
and more (on an AMX build the VNNI loop takes those rows on its exact int8 tiles) and, started in two waves,
steps of prompt and generated rows together (each run of rows multiplied in place, the prompt runs on the
bf16 tile loop); every request is compared with itself alone, bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend.backend import PytorchBackend

REQUESTS = 20
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(default_gguf_path), kv_cache_memory_gib=0.25)))
    yield engine
    asyncio.run(engine.close())


def _prompts(engine: AsyncEngine) -> list[list[int]]:
    """Chat prompts of different lengths (so that their prefills end in different steps)."""
    tokenizer = engine.tokenizer
    questions = [f"List {i + 2} facts about the number {7 * i + 3}" + " in detail" * (i % 5) for i in range(REQUESTS)]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True)) for q in questions]


def _tokens_and_logprobs(response) -> tuple[list[int], list[float]]:
    return list(response.token_ids), [entry.logprob for entry in response.choices[0].logprobs]


def test_a_requests_greedy_tokens_and_logprobs_do_not_depend_on_its_neighbours(engine):
    prompts = _prompts(engine)

    async def late(prompt: list[int]):
        await asyncio.sleep(0.05)  # the second wave's prefills join the first wave's decode steps
        return await collect(engine.generate(prompt, GREEDY))

    async def run():
        alone = [await collect(engine.generate(prompt, GREEDY)) for prompt in prompts]
        together = await asyncio.gather(*(collect(engine.generate(prompt, GREEDY)) for prompt in prompts))
        waves = await asyncio.gather(*(collect(engine.generate(prompt, GREEDY)) for prompt in prompts[::2]),
                                     *(late(prompt) for prompt in prompts[1::2]))
        return alone, together, list(waves[: REQUESTS // 2]), list(waves[REQUESTS // 2 :])

    alone, together, first_wave, second_wave = asyncio.run(run())
    in_waves = [None] * REQUESTS
    in_waves[::2], in_waves[1::2] = first_wave, second_wave
    for index, (one, many, waved) in enumerate(zip(alone, together, in_waves, strict=True)):
        expected = _tokens_and_logprobs(one)
        assert len(expected[0]) == GREEDY.max_new_tokens
        assert _tokens_and_logprobs(many) == expected, f"request {index} together"
        assert _tokens_and_logprobs(waved) == expected, f"request {index} in waves"
