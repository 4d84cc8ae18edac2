"""The default model (SmolLM2-135M-Instruct, its GGUF served packed) with n-gram speculation gives the
greedy tokens it gives without, one request alone and 16 concurrent mixed ones (texts to repeat, where
lookup is accepted, and questions, where it mostly is not) under chunked prefill, prefix caching and a KV
budget small enough to preempt."""

from __future__ import annotations

import asyncio

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.speculative import SpeculativeConfig
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

TEXTS = (
    "The river runs through the old town, past the mill and the church, and under the stone bridge that "
    "the farmers built long ago.",
    "Please bring three apples, a loaf of bread and some cheese when you come home from the market tonight.",
    "Our meeting on Friday starts at nine in the small room next to the library; bring the reports.",
)
QUESTIONS = ("What are the three primary colors?", "Who wrote Romeo and Juliet?",
             "Explain what a CPU does in one sentence.", "What is 2 + 2?")
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # layers x (K, V) x tokens x KV heads x head dim x bf16


def chat_prompts(tokenizer) -> list[list[int]]:
    """16 chat prompts as token ids: texts to repeat or correct (lookup helps), questions (it does not)."""
    asks = [f"Repeat the following text exactly, word for word:\n\n{t}" for t in TEXTS]
    asks += [f"Correct the spelling of this text and write it out again:\n\n{t.replace('e', 'ee', 2)}" for t in TEXTS]
    asks += list(QUESTIONS)
    prompts = []
    for ask in (asks * 2)[:16]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


async def run(engine: AsyncEngine, messages, configs):
    return await asyncio.gather(*(collect(engine.generate(m, c)) for m, c in zip(messages, configs, strict=True)))


def make_engine(path, spec=None, **options) -> AsyncEngine:
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), speculative=spec, **options)))


async def test_default_model_greedy_output_is_unchanged_by_ngram_speculation(default_gguf_path):
    configs = [GenerationConfig(temperature=0.0, max_new_tokens=24 + 8 * (i % 4)) for i in range(16)]
    options = {"max_num_batched_tokens": 96, "kv_cache_memory_gib": 48 * BLOCK_BYTES / 2**30}
    spec = SpeculativeConfig("ngram", num_speculative_tokens=5, ngram_min=1, ngram_max=3)
    results = {}
    for name, speculative in (("plain", None), ("ngram", spec)):
        engine = make_engine(default_gguf_path, speculative, **options)
        try:
            messages = chat_prompts(engine.backend.tokenizer)
            assert engine.stats().kv_blocks_total == 48  # 16 requests need ~100: preemption
            single = await collect(engine.generate(messages[0], configs[0]))
            together = await run(engine, messages, configs)
            results[name] = [single.token_ids] + [r.token_ids for r in together]
            stats = await wait_idle(engine, timeout=30)
            assert_idle(engine, stats)
            if speculative is not None:
                spec_stats = stats.spec_decode
                assert spec_stats.num_accepted_tokens > 0.5 * spec_stats.num_draft_tokens > 0
        finally:
            await engine.close()
    for i, (plain, speculated) in enumerate(zip(results["plain"], results["ngram"], strict=True)):
        assert speculated == plain, i

