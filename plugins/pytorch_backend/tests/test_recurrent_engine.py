"""A model with recurrent layers through the whole engine (LFM2: short convolutions beside attention; Mamba-2:
no attention, no KV cache; Qwen3.5: gated DeltaNet beside attention): greedy parity with transformers under continuous batching and chunked prefill,
preemption, n > 1 forks (a copied state), sleep cycles, prefix caching through state snapshots (multi-turn
conversations start from the last one's prompt), state slots back to none when idle,
speculative decoding refused, a request that its sampler rejects failing alone (the others' outputs computed
from the same forward pass), and a failed forward ending its requests without touching the next ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import BackendError, UnsupportedError
from core.response import collect
from core.speculative import SpeculativeConfig
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.layers.recurrent import recurrent_layers
from core_pytorch_backend.model_runner import BLOCKS_WITHOUT_KV
from core_pytorch_backend.testing import TINY_VOCAB, built_once, hf_greedy, reinit_, tiny_tokenizer

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, bos_token_id=257, eos_token_id=258,
              pad_token_id=259, tie_word_embeddings=False)
CONFIGS = {
    # 2 attention layers x 2 KV heads x 16 dims x fp32: 8 KiB a block of 16 tokens
    "lfm2": ("Lfm2Config", dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, layer_types=["conv", "full_attention"] * 2)),
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2, chunk_size=8)),
    # gated DeltaNet layers then attention (Qwen3.5's layout at a tiny size), its M-RoPE text positions
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
}


def _build(name: str, folder: Path) -> Path:
    import transformers

    cls_name, overrides = CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model, std=0.2)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("conv.weight") or param_name.endswith("conv1d.weight"):
                param.mul_(2.5)  # taps that move the tokens
            elif param_name.endswith("A_log") or param_name.endswith("dt_bias"):
                param.copy_(torch.linspace(-1.0, 1.0, param.numel()).view_as(param))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, _build)


_HF: dict[Path, torch.nn.Module] = {}


def reference(path: Path, prompt: list[int], new_tokens: int = 12) -> list[int]:
    from transformers import AutoModelForCausalLM

    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(_HF[path], prompt, new_tokens)


def engine_of(path: Path, **options) -> AsyncEngine:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), **options)))


def prompts_of_different_lengths(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 37)] for i in range(count)]


async def generate_all(engine: AsyncEngine, prompts, config=GREEDY):
    return await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))


async def idle_without_slots(engine: AsyncEngine) -> None:
    """Idle, no sequence holding a state slot (the prefix cache's snapshots have slots of their own)."""
    assert_idle(engine, await wait_idle(engine))
    assert engine.backend.loop.scheduler.state_slots.in_use == 0


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_greedy_parity_single_and_12_concurrent_in_chunks(checkpoint, name):
    path = checkpoint(name)
    engine = engine_of(path, max_num_batched_tokens=32)  # long prompts prefill in several chunks
    try:
        prompts = prompts_of_different_lengths(12)
        single = await collect(engine.generate(prompts[5], GREEDY))
        assert single.token_ids == reference(path, prompts[5])
        for prompt, response in zip(prompts, await generate_all(engine, prompts), strict=True):
            assert response.token_ids == reference(path, prompt), prompt
        await idle_without_slots(engine)
    finally:
        await engine.close()


async def test_a_model_without_attention_owns_no_kv_cache(checkpoint):
    engine = engine_of(checkpoint("mamba2"))
    try:
        runner = engine.backend.loop.runner
        assert runner.num_blocks == BLOCKS_WITHOUT_KV and runner.kv_caches == []
        assert len(recurrent_layers(runner.model)) == 4
    finally:
        await engine.close()


async def test_preemption_recomputes_the_state_and_loses_nothing(checkpoint):
    path = checkpoint("lfm2")
    prompts = prompts_of_different_lengths(12)
    config = GREEDY.replace(max_new_tokens=20)
    tight = engine_of(path, kv_cache_memory_gib=10 * 8192 / 2**30, max_model_len=160)  # ~3 requests at once
    try:
        got = await generate_all(tight, prompts, config)
        assert [r.token_ids for r in got] == [reference(path, p, 20) for p in prompts]
        assert tight.stats().kv_blocks_total == 10
        await idle_without_slots(tight)
    finally:
        await tight.close()


async def test_n_choices_fork_the_state(checkpoint):
    path = checkpoint("lfm2")
    engine = engine_of(path)
    try:
        prompt = prompts_of_different_lengths(8)[7]
        greedy = await collect(engine.generate(prompt, GREEDY.replace(n=3)))
        assert [c.token_ids for c in greedy.choices] == [reference(path, prompt)] * 3
        sampled = GenerationConfig(temperature=1.0, seed=7, n=3, max_new_tokens=8, ignore_eos=True)
        first = await collect(engine.generate(prompt, sampled))
        assert len({tuple(c.token_ids) for c in first.choices}) > 1
        alone = await collect(engine.generate(prompt, sampled))
        crowded, *_ = await generate_all(engine, [prompt, *prompts_of_different_lengths(4)], sampled)
        assert [c.token_ids for c in alone.choices] == [c.token_ids for c in first.choices]
        assert [c.token_ids for c in crowded.choices] == [c.token_ids for c in first.choices]
        await idle_without_slots(engine)
    finally:
        await engine.close()


async def test_prefix_cache_hits_and_sleep_cycles_keep_outputs(checkpoint):
    path = checkpoint("lfm2")
    engine = engine_of(path)
    prompt = prompts_of_different_lengths(8)[6]  # 33 tokens: its state is kept after 32 (2 blocks of 16)
    try:
        before = await collect(engine.generate(prompt, GREEDY))
        again = await collect(engine.generate(prompt, GREEDY))
        assert again.token_ids == before.token_ids == reference(path, prompt)
        assert again.cached_tokens == 32 and engine.stats().prefix_cache_hits == 32
        for cycle in range(3):
            await engine.sleep(1 + cycle % 2)
            assert engine.backend.loop.runner.recurrent_states == []
            assert len(engine.backend.loop.scheduler.state_cache) == 0
            await engine.wakeup(["weights"])
            await engine.wakeup(["kv_cache"])
            assert (await collect(engine.generate(prompt, GREEDY))).token_ids == before.token_ids
        await idle_without_slots(engine)
    finally:
        await engine.close()


def test_speculative_decoding_is_refused_at_start(checkpoint):
    with pytest.raises(UnsupportedError, match="speculative decoding is not supported") as caught:
        PytorchBackend(EngineConfig(model=str(checkpoint("lfm2")), dtype="float32", kv_cache_memory_gib=0.01,
                                    speculative=SpeculativeConfig("ngram", num_speculative_tokens=4)))
    assert caught.value.param == "speculative"


async def test_a_failed_step_ends_its_requests_and_the_next_ones_are_right(checkpoint):
    path = checkpoint("lfm2")
    engine = engine_of(path)
    layer = recurrent_layers(engine.backend.loop.runner.model)[1]
    original = layer.forward
    calls = {"n": 0}

    def fails_on_the_third_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    layer.forward = fails_on_the_third_step
    prompts = prompts_of_different_lengths(6)[3:]
    try:
        results = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in prompts),
                                       return_exceptions=True)
        assert all(isinstance(r, BackendError) and "engine step failed" in str(r) for r in results), results
        for prompt, response in zip(prompts, await generate_all(engine, prompts), strict=True):
            assert response.token_ids == reference(path, prompt)
        await idle_without_slots(engine)
    finally:
        layer.forward = original
        await engine.close()


async def test_a_request_whose_sampling_fails_fails_alone(checkpoint):
    """The sampler refuses one request of the step (a banned stop token outside the vocabulary, sent to the
    backend directly): the others' tokens come from the same forward, so their states advance once."""
    from core.backend import GenerateRequest

    path = checkpoint("qwen3_5")
    engine = engine_of(path)
    prompts = prompts_of_different_lengths(4)
    bad = GenerateRequest("bad", [5, 6, 7], GREEDY.replace(min_new_tokens=5), max_new_tokens=20,
                          stop_token_ids=frozenset({TINY_VOCAB + 50}))

    async def bad_request() -> list:
        try:
            return [output async for output in engine.backend.generate(bad)]
        finally:
            await engine.backend.end("bad")

    try:
        streams = [engine.generate(p, GREEDY) for p in prompts]
        firsts = await asyncio.gather(*(stream.__anext__() for stream in streams))
        failing = asyncio.ensure_future(bad_request())
        responses = await asyncio.gather(*(collect(stream) for stream in streams))
        with pytest.raises(BackendError, match="engine step failed"):
            await failing
        for prompt, first, response in zip(prompts, firsts, responses, strict=True):
            assert response.finish_reason == "length"
            assert first.token_ids + response.token_ids == reference(path, prompt)
        await idle_without_slots(engine)
    finally:
        await engine.close()


def conversation_turns(index: int, turns: int) -> list[list[int]]:
    """A chat's prompts without the replies: turn t is turn t-1's prompt, its reply, then a new message."""
    first = [(13 * index + 5 * j + 1) % 250 for j in range(18 + 9 * index)]
    return [first, *([(7 * index + 3 * t + j) % 250 for j in range(4 + t)] for t in range(1, turns))]


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_multi_turn_conversations_start_from_a_state_snapshot_and_match_transformers(checkpoint, name):
    path = checkpoint(name)
    engine = engine_of(path, max_num_batched_tokens=24)  # chunked prefill too
    chats = [conversation_turns(i, 3) for i in range(3)]
    try:
        histories = [chat[0] for chat in chats]
        for turn in range(3):
            if turn:
                histories = [h + chat[turn] for h, chat in zip(histories, chats, strict=True)]
            responses = await generate_all(engine, histories)
            for history, response in zip(histories, responses, strict=True):
                assert response.token_ids == reference(path, history)
                if turn:  # the last turn's prompt, up to its last block boundary, came from the cache
                    assert response.cached_tokens >= 16
            histories = [h + r.token_ids for h, r in zip(histories, responses, strict=True)]
        scheduler = engine.backend.loop.scheduler
        assert scheduler.state_slots.peak <= len(chats) < len(scheduler.state_cache)  # snapshots apart: dense slots
        await idle_without_slots(engine)
    finally:
        await engine.close()


async def test_prefix_caching_off_keeps_no_snapshots(checkpoint):
    path = checkpoint("qwen3_5")
    engine = engine_of(path, enable_prefix_caching=False)
    prompt = prompts_of_different_lengths(8)[6]
    try:
        for _ in range(2):
            response = await collect(engine.generate(prompt, GREEDY))
            assert response.token_ids == reference(path, prompt) and response.cached_tokens == 0
        assert engine.backend.loop.scheduler.state_cache is None
        await idle_without_slots(engine)
    finally:
        await engine.close()
