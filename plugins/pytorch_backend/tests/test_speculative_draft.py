"""The draft-model proposer on tiny checkpoints of one tokenizer: greedy output with a draft model equals
output without it (a draft identical to the target: every draft accepted; another random model: few), under
concurrency and preemption; the draft's own KV blocks go back when the sequences end."""

from __future__ import annotations

import asyncio

import pytest

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import InvalidRequestError
from core.response import collect
from core.speculative import SpeculativeConfig
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True)
PROMPTS = [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 23)] for i in range(8)]


def make_engine(path, spec=None, **options) -> AsyncEngine:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), speculative=spec, **options)))


async def outputs(engine: AsyncEngine) -> list[list[int]]:
    results = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in PROMPTS))
    return [r.token_ids for r in results]


@pytest.mark.parametrize("draft_seed", [0, 1])
async def test_greedy_with_a_draft_model_equals_without(tiny_checkpoint_factory, make_tiny_checkpoint, tmp_path,
                                                        draft_seed):
    target = tiny_checkpoint_factory("llama")
    draft = target if draft_seed == 0 else make_tiny_checkpoint("llama", tmp_path, seed=draft_seed)
    plain = make_engine(target)
    try:
        expected = await outputs(plain)
    finally:
        await plain.close()
    engine = make_engine(target, SpeculativeConfig("draft", num_speculative_tokens=4, draft_model=str(draft)),
                         kv_cache_memory_gib=10 * 8192 / 2**30, max_model_len=160)  # preemption
    try:
        assert await outputs(engine) == expected
        stats = await wait_idle(engine)
        assert_idle(engine, stats)
        spec = stats.spec_decode
        assert spec.num_draft_tokens > 0
        if draft_seed == 0:  # the target drafting for itself: every draft is what it would say
            assert spec.num_accepted_tokens == spec.num_draft_tokens
        assert engine.backend.loop.speculative.proposer.num_used_blocks == 0
    finally:
        await engine.close()


def test_draft_needs_a_draft_model(tiny_checkpoint_factory):
    with pytest.raises(InvalidRequestError) as info:
        make_engine(tiny_checkpoint_factory("llama"), SpeculativeConfig("draft"))
    assert info.value.param == "draft_model"
