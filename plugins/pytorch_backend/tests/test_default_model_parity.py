"""SmolLM2-135M-Instruct (the default model, from its GGUF) through the pytorch backend: the first 32
greedy tokens of 4 chat prompts equal transformers' own generate on the same GGUF, float32, CPU, for the
prompts one at a time and all four in one continuous batch.

The prompts avoid near ties: "What is the capital of France?" is one (0.152 vs 0.140 for the first
token) and is not used; `test_prompts_are_not_near_ties` checks the margin the comparison relies on.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend.backend import PytorchBackend

NEW_TOKENS = 32
QUESTIONS = (  # smallest top-2 probability margins over the 32 steps, measured: 0.041, 0.027, 0.011, 0.0097
    "What are the three primary colors?",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
    "Explain what a CPU does in one sentence.",
)
MIN_TOP2_MARGIN = 0.005  # probability gap between the two likeliest tokens at every greedy step


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference(default_hf_model, default_model):
    """(prompt ids, transformers' greedy continuation, smallest top-2 margin) per question."""
    saved = copy.deepcopy(default_hf_model.generation_config)
    # eos neither stops nor is suppressed (what ignore_eos means); None in a passed config means "default"
    default_hf_model.generation_config.eos_token_id = None
    try:
        return [_reference_one(default_hf_model, default_model.tokenizer, q) for q in QUESTIONS]
    finally:
        default_hf_model.generation_config = saved


def _reference_one(hf_model, tokenizer, question: str) -> tuple[list[int], list[int], float]:
    prompt = chat_prompt(tokenizer, question)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    probs = torch.stack(gen.scores)[:, 0].softmax(-1).topk(2).values
    return prompt, gen.sequences[0, len(prompt):].tolist(), float((probs[:, 0] - probs[:, 1]).min())


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(default_gguf_path), dtype="float32",
                                                     quantization="none", kv_cache_memory_gib=0.25)))
    yield engine
    asyncio.run(engine.close())


GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_prompts_are_not_near_ties(reference):
    for (_, _, margin), question in zip(reference, QUESTIONS, strict=True):
        assert margin > MIN_TOP2_MARGIN, f"{question!r} has a near tie (margin {margin:.4f}): pick another prompt"


def test_greedy_tokens_equal_transformers_one_by_one_and_batched(engine, reference):
    async def run():
        alone = [await collect(engine.generate(prompt, GREEDY)) for prompt, _, _ in reference]
        batched = await asyncio.gather(*(collect(engine.generate(prompt, GREEDY)) for prompt, _, _ in reference))
        return alone, batched

    alone, batched = asyncio.run(run())
    for (_, expected, _), one, many in zip(reference, alone, batched, strict=True):
        assert list(one.token_ids) == expected
        assert list(many.token_ids) == expected
