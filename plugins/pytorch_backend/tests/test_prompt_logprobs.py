"""Prompt logprobs of the pytorch backend against transformers' log-softmax (float32, within 1e-4): under
chunked prefill, a batch of several requests, n > 1, preemption, and a cached prefix (not read)."""

from __future__ import annotations

import asyncio

import torch

from core.backend import TokenLogprob
from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.prompt_logprobs import PromptScores

TOLERANCE = 1e-4
K = 3


def make_engine(path, **options) -> AsyncEngine:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), **options)))


def reference(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax predicting prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def assert_matches(entries: list[TokenLogprob | None], prompt: list[int], expected: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row = expected[i]
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - row[prompt[i + 1]].item()) < TOLERANCE
        assert entry.rank == int((row > row[prompt[i + 1]]).sum()) + 1
        top = row.topk(K)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist(), strict=True)) < TOLERANCE


PROMPTS = [[(13 * i + 5 * j + 1) % 250 for j in range(9 + 11 * i)] for i in range(4)]
CONFIG = GenerationConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True, prompt_logprobs=K)


async def test_chunked_batched_and_cached_prompts_score_like_transformers(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    engine = make_engine(path, max_num_batched_tokens=10)  # every prompt is prefilled in chunks
    try:
        await collect(engine.generate(PROMPTS[3], GenerationConfig(max_new_tokens=1)))  # now cached
        results = await asyncio.gather(*(collect(engine.generate(p, CONFIG.replace(n=2))) for p in PROMPTS))
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert_matches(result.prompt_logprobs, prompt, reference(path, prompt))
            assert result.cached_tokens == 0 and len(result.choices) == 2
        plain = await collect(engine.generate(PROMPTS[3], GenerationConfig(max_new_tokens=1)))
        assert plain.prompt_logprobs is None and plain.cached_tokens > 0
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_preempted_requests_score_each_position_once(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen2")
    prompts = [[(11 * i + 7 * j + 3) % 250 for j in range(20 + 9 * i)] for i in range(6)]
    # 10 blocks of 16 tokens hold about three of these requests at once: the others are preempted
    engine = make_engine(path, kv_cache_memory_gib=10 * 8192 / 2**30, max_model_len=160)
    try:
        config = CONFIG.replace(max_new_tokens=30)
        results = await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            assert_matches(result.prompt_logprobs, prompt, reference(path, prompt))
    finally:
        await engine.close()


def test_prompt_scores_skip_positions_already_scored():
    scores = PromptScores([5, 6, 7, 8], k=0)
    entry = [TokenLogprob(t, -1.0) for t in (6, 7)]
    scores.add(0, entry)
    assert scores.targets(2, 5) == [8] and scores.next_position() == 2
    scores.add(0, entry)  # a recompute from the start adds nothing
    scores.add(1, [TokenLogprob(7, -2.0), TokenLogprob(8, -3.0)])
    assert [e.token_id for e in scores.entries[1:]] == [6, 7, 8] and scores.complete
    assert scores.entries[2].logprob == -1.0
