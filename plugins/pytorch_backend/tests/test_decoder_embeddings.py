"""Embeddings from generating models through the paged runner (pooled_prompt.py) against transformers'
final normed hidden states (`last_hidden_state`), float32, within 1e-4: last-token pooling (the default,
normalised) and mean pooling (a sentence-transformers Pooling module), under chunked prefill, batched with
generation, served from the prefix cache, and with every KV block freed afterwards."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.pooling import PoolingConfig
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.pooled_prompt import PooledPrompt

TOLERANCE = 1e-4
PROMPTS = [[(7 * i + 3 * j + 2) % 250 for j in range(5 + 13 * i)] for i in range(4)]


def make_engine(path, **options) -> AsyncEngine:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), **options)))


def reference(path, prompt: list[int], pooling: PoolingConfig) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) of `prompt`, pooled."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden.mean(0) if pooling.method == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=-1) if pooling.normalize else vector


def assert_close(vector, expected: torch.Tensor) -> None:
    assert len(vector) == expected.shape[0]
    assert (torch.tensor(vector) - expected).abs().max().item() < TOLERANCE


@pytest.fixture
def mean_pooling_checkpoint(tiny_checkpoint_factory, tmp_path):
    """The tiny Qwen2 with sentence-transformers files that ask for mean pooling, not normalised."""
    path = shutil.copytree(tiny_checkpoint_factory("qwen2"), tmp_path / "tiny-qwen2-st")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
async def test_last_token_pooling_by_default_matches_transformers(tiny_checkpoint_factory, arch, caplog):
    path = tiny_checkpoint_factory(arch)
    engine = make_engine(path, max_num_batched_tokens=16)  # the longer prompts are prefilled in chunks
    try:
        assert engine.backend.pooling == PoolingConfig(method="last", normalize=True)
        with caplog.at_level(logging.WARNING, logger="core_pytorch_backend.backend"):
            embeddings = await engine.embed(PROMPTS)
        assert "last-token pooling" in caplog.text
        for prompt, embedding in zip(PROMPTS, embeddings, strict=True):
            assert_close(embedding.vector, reference(path, prompt, engine.backend.pooling))
            assert embedding.prompt_tokens == len(prompt)
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_mean_pooling_from_sentence_transformers_files(mean_pooling_checkpoint):
    engine = make_engine(mean_pooling_checkpoint, max_num_batched_tokens=16)
    try:
        pooling = engine.backend.pooling
        assert pooling == PoolingConfig(method="mean", normalize=False)
        first = await engine.embed(PROMPTS[3:])  # now in the prefix cache, which mean pooling must not read
        again = await engine.embed(PROMPTS)
        for prompt, embedding in zip(PROMPTS, again, strict=True):
            assert_close(embedding.vector, reference(mean_pooling_checkpoint, prompt, pooling))
        assert first[0].vector == pytest.approx(again[3].vector, abs=1e-6)
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_embeddings_batch_with_generation_and_read_the_prefix_cache(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    engine = make_engine(path, max_num_batched_tokens=24)
    config = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    try:
        alone = await collect(engine.generate(PROMPTS[2], config))
        hits = engine.stats().prefix_cache_hits
        cached = await engine.embed([PROMPTS[2]])
        assert engine.stats().prefix_cache_hits > hits  # PROMPTS[2]'s blocks were served from the cache
        together = await asyncio.gather(collect(engine.generate(PROMPTS[1], config)),
                                        engine.embed([PROMPTS[2], PROMPTS[0]]), collect(engine.generate(PROMPTS[2], config)))
        assert together[2].choices[0].token_ids == alone.choices[0].token_ids  # unchanged by the embeddings
        pooling = engine.backend.pooling
        assert_close(cached[0].vector, reference(path, PROMPTS[2], pooling))
        for prompt, embedding in zip([PROMPTS[2], PROMPTS[0]], together[1], strict=True):
            assert_close(embedding.vector, reference(path, prompt, pooling))
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_mean_pooling_survives_preemption(mean_pooling_checkpoint):
    prompts = [[(11 * i + 7 * j + 3) % 250 for j in range(20 + 9 * i)] for i in range(6)]
    # 10 blocks of 16 tokens hold about three of these requests at once: the others are preempted
    engine = make_engine(mean_pooling_checkpoint, kv_cache_memory_gib=10 * 8192 / 2**30, max_model_len=160,
                         max_num_batched_tokens=32)
    config = GenerationConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    try:
        generated = [collect(engine.generate(p, config)) for p in prompts[:3]]
        *_, embeddings = await asyncio.gather(*generated, engine.embed(prompts[3:]))
        for prompt, embedding in zip(prompts[3:], embeddings, strict=True):
            assert_close(embedding.vector, reference(mean_pooling_checkpoint, prompt, engine.backend.pooling))
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


def test_pooled_prompt_adds_each_position_once():
    pooled = PooledPrompt(PoolingConfig(method="mean", normalize=False), num_tokens=4)
    rows = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    pooled.add(0, rows[:3])
    pooled.add(0, rows[:2])  # a recompute after a preemption adds nothing
    assert not pooled.complete
    pooled.add(2, rows[2:])
    assert pooled.complete and pooled.vector() == rows.mean(0).tolist()
    last = PooledPrompt(PoolingConfig(method="last", normalize=False), num_tokens=4)
    assert last.positions == range(3, 4) and last.reads_prefix_cache
    last.add(3, rows[3:])
    assert last.vector() == rows[3].tolist()
