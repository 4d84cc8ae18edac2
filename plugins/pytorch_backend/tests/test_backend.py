"""The pytorch backend end to end: greedy parity with transformers under continuous batching, prefix
caching, preemption, seeded sampling, logprobs, n > 1, sleep cycles and block accounting; and the core's
backend contract suite.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.testing.contract import BackendContractTests, assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def make_backend(path, **options) -> PytorchBackend:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return PytorchBackend(EngineConfig(model=str(path), **options))


def reference_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy generate on the same weights, with eos disabled (ignore_eos)."""
    model = _hf_model(str(path))
    ids = torch.tensor([prompt])  # an explicit mask: a prompt may contain the pad token's id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_HF_CACHE: dict[str, torch.nn.Module] = {}


def _hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        _HF_CACHE[path] = model
    return _HF_CACHE[path]


def prompts_of_different_lengths(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 37)] for i in range(count)]


async def generate_all(engine: AsyncEngine, prompts, config=GREEDY):
    return await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
async def test_greedy_parity_single_and_16_concurrent(tiny_checkpoint_factory, arch):
    path = tiny_checkpoint_factory(arch)
    engine = AsyncEngine(make_backend(path, max_num_batched_tokens=64))  # forces chunked prefill too
    try:
        prompts = prompts_of_different_lengths(16)
        single = await collect(engine.generate(prompts[5], GREEDY))
        assert single.token_ids == reference_greedy(path, prompts[5], 12)
        together = await generate_all(engine, prompts)
        for prompt, response in zip(prompts, together, strict=True):
            assert response.token_ids == reference_greedy(path, prompt, 12), prompt
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_prefix_cache_hits_and_does_not_change_outputs(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama", max_position_embeddings=1024)
    shared = [(13 * j + 5) % 250 for j in range(256)]
    prompts = [shared + [1, 2, 3], shared + [4, 5, 6, 7]]
    cached = AsyncEngine(make_backend(path))
    uncached = AsyncEngine(make_backend(path, enable_prefix_caching=False))
    try:
        first = await collect(cached.generate(prompts[0], GREEDY))
        second = await collect(cached.generate(prompts[1], GREEDY))
        assert first.cached_tokens == 0 and second.cached_tokens == 256
        plain = [await collect(uncached.generate(p, GREEDY)) for p in prompts]
        assert [r.token_ids for r in plain] == [first.token_ids, second.token_ids]
        assert plain[1].cached_tokens == 0
        assert cached.stats().prefix_cache_hits == 256
    finally:
        await cached.close()
        await uncached.close()


async def test_preemption_under_a_tiny_cache_loses_nothing(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen2")
    prompts = prompts_of_different_lengths(12)
    config = GREEDY.replace(max_new_tokens=20)
    roomy = AsyncEngine(make_backend(path))
    # 2 layers x 2 kv heads x 16 dims x fp32: 8 KiB a block of 16 tokens; 10 blocks hold ~3 requests.
    tight = AsyncEngine(make_backend(path, kv_cache_memory_gib=10 * 8192 / 2**30, max_model_len=160))
    try:
        expected = [r.token_ids for r in await generate_all(roomy, prompts, config)]
        got = await generate_all(tight, prompts, config)
        assert [r.token_ids for r in got] == expected
        assert tight.stats().kv_blocks_total == 10
        assert_idle(tight, await wait_idle(tight))
    finally:
        await roomy.close()
        await tight.close()


async def test_a_preempted_sequence_continues_bit_for_bit_in_bfloat16(tiny_checkpoint_factory):
    """A preempted sequence's recomputed output is attended one generated token a row, as the decode steps
    that made it were (model_runner._attention_rows), so it continues with the same logits bit for bit
    (each token's logprob), in a bfloat16 model with heads of 64, whose chunk and decode attention round
    differently; a bfloat16 model's weights multiply the same way at any batch (native/half_linear)."""
    path = tiny_checkpoint_factory("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=256)
    prompts = prompts_of_different_lengths(12)
    config = GREEDY.replace(max_new_tokens=20, logprobs=True)
    roomy = AsyncEngine(make_backend(path, dtype="bfloat16"))
    # 2 layers x 1 kv head x 64 dims x bf16: 8 KiB a block of 16 tokens; 10 blocks hold ~3 requests.
    tight = AsyncEngine(make_backend(path, dtype="bfloat16", kv_cache_memory_gib=10 * 8192 / 2**30,
                                     max_model_len=160))
    try:
        def outputs(responses):
            return [(r.token_ids, [lp.logprob for lp in r.choices[0].logprobs]) for r in responses]

        expected = outputs(await generate_all(roomy, prompts, config))
        assert outputs(await generate_all(tight, prompts, config)) == expected
        assert tight.stats().kv_blocks_total == 10
        assert_idle(tight, await wait_idle(tight))
    finally:
        await roomy.close()
        await tight.close()


async def test_seeded_sampling_is_reproducible_across_batches(tiny_checkpoint_factory):
    engine = AsyncEngine(make_backend(tiny_checkpoint_factory("llama")))
    seeded = GenerationConfig(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=10, ignore_eos=True)
    try:
        prompt = [3, 14, 15, 92, 65]
        alone = await collect(engine.generate(prompt, seeded))
        crowd = [collect(engine.generate(p, GenerationConfig(temperature=1.0, max_new_tokens=10, ignore_eos=True)))
                 for p in prompts_of_different_lengths(6)]
        results = await asyncio.gather(*crowd[:3], collect(engine.generate(prompt, seeded)), *crowd[3:])
        assert results[3].token_ids == alone.token_ids
        other_seed = await collect(engine.generate(prompt, seeded.replace(seed=99)))
        assert other_seed.token_ids != alone.token_ids
    finally:
        await engine.close()


async def test_logprobs_match_transformers(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    engine = AsyncEngine(make_backend(path))
    try:
        prompt = [9, 8, 7, 6, 5, 4]
        response = await collect(engine.generate(prompt, GREEDY.replace(logprobs=True, top_logprobs=3, max_new_tokens=4)))
        with torch.no_grad():
            logits = _hf_model(str(path))(torch.tensor([prompt + response.token_ids])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: -1]
        for step, lp in enumerate(response.choices[0].logprobs):
            assert abs(lp.logprob - reference[step, lp.token_id].item()) < 1e-4
            top_ids = torch.topk(reference[step], 3).indices.tolist()
            assert [t for t, _ in lp.top] == top_ids
    finally:
        await engine.close()


async def test_n_choices_share_the_prompt_blocks(tiny_checkpoint_factory):
    engine = AsyncEngine(make_backend(tiny_checkpoint_factory("llama")))
    try:
        config = GenerationConfig(temperature=1.0, seed=7, n=3, max_new_tokens=8, ignore_eos=True)
        prompt = [(5 * j) % 250 for j in range(40)]
        response = await collect(engine.generate(prompt, config))
        assert [len(c.token_ids) for c in response.choices] == [8, 8, 8]
        assert len({tuple(c.token_ids) for c in response.choices}) > 1
        again = await collect(engine.generate(prompt, config))
        assert [c.token_ids for c in again.choices] == [c.token_ids for c in response.choices]
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_an_unzeroed_cache_full_of_nan_is_zeroed_before_use(tiny_checkpoint_factory):
    """The CPU cache starts unzeroed and is zeroed block by block as steps reach it. Filled with NaN
    at start (what memory never written may hold), it gives transformers' greedy outputs all the same:
    a batch of different lengths (padded block tables) and an n > 1 fork (a block copy)."""
    path = tiny_checkpoint_factory("llama")
    backend = make_backend(path, max_num_batched_tokens=64)
    runner = backend.loop.runner

    def poison() -> None:
        for k_cache, v_cache in runner.kv_caches:
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))

    await asyncio.wrap_future(backend.loop.call(poison))
    assert runner.zeroed_blocks == 0
    engine = AsyncEngine(backend)
    try:
        prompts = prompts_of_different_lengths(8)
        for prompt, response in zip(prompts, await generate_all(engine, prompts), strict=True):
            assert response.token_ids == reference_greedy(path, prompt, 12), prompt
        forked = await collect(engine.generate(prompts[3], GREEDY.replace(n=2)))
        assert [c.token_ids for c in forked.choices] == [reference_greedy(path, prompts[3], 12)] * 2
        assert 0 < runner.zeroed_blocks < runner.num_blocks  # only the blocks reached so far
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_five_sleep_cycles_keep_greedy_outputs(tiny_checkpoint_factory):
    engine = AsyncEngine(make_backend(tiny_checkpoint_factory("qwen3")))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    try:
        before = (await collect(engine.generate(prompt, GREEDY))).token_ids
        for cycle in range(5):
            await engine.sleep(1 + cycle % 2)
            await engine.wakeup(["weights"])
            await engine.wakeup(["kv_cache"])
            assert (await collect(engine.generate(prompt, GREEDY))).token_ids == before
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


async def test_a_step_without_kv_cache_is_a_clear_error_and_serving_resumes(tiny_checkpoint_factory):
    backend = make_backend(tiny_checkpoint_factory("llama"))
    engine = AsyncEngine(backend)
    try:
        stream = engine.generate([1, 2, 3], GREEDY.replace(max_new_tokens=200))
        await stream.__anext__()
        await asyncio.wrap_future(backend.loop.call(backend.loop.runner.free_kv_cache))  # simulate the loss
        from core.errors import BackendError

        with pytest.raises(BackendError, match="KV cache"):
            async for _ in stream:
                pass
        await asyncio.wrap_future(backend.loop.call(backend.loop.block_manager.reset))
        await asyncio.wrap_future(backend.loop.call(backend.loop.runner.allocate_kv_cache))
        assert (await collect(engine.generate([1, 2, 3], GREEDY))).finish_reason == "length"
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


class TestPytorchBackendContract(BackendContractTests):
    @pytest.fixture
    async def backend(self, tiny_checkpoint_factory):
        backend = make_backend(tiny_checkpoint_factory("llama"))
        yield backend
        await backend.close()


def test_backend_options_are_validated():
    from core.errors import InvalidRequestError
    from core_pytorch_backend.backend import PytorchOptions

    assert PytorchOptions.from_mapping({}) == PytorchOptions()
    assert PytorchOptions.from_mapping({"enforce_eager": True}).enforce_eager
    with pytest.raises(InvalidRequestError, match="kv_cache_memory_fraction"):
        PytorchOptions.from_mapping({"kv_cache_memory_fraction": 1.5})
    with pytest.raises(InvalidRequestError, match="'eager'"):
        PytorchOptions.from_mapping({"eager": True})
    assert PytorchOptions().amx_rows == "prompt" and PytorchOptions.from_mapping({"amx_rows": "all"}).amx_rows == "all"
    with pytest.raises(InvalidRequestError, match="amx_rows must be one of prompt, all, none, got 'decode'"):
        PytorchOptions.from_mapping({"amx_rows": "decode"})


def test_a_checkpoint_setting_no_layer_implements_is_a_clear_start_up_error(tiny_checkpoint_factory):
    """`core serve` prints a CoreError as one line (a NotImplementedError was a traceback)."""
    from core.errors import UnsupportedError

    path = tiny_checkpoint_factory("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.35})
    with pytest.raises(UnsupportedError, match="partial_rotary_factor 0.35 gives 5 rotated values"):
        make_backend(path)


def test_max_model_len_past_the_models_positions_is_refused_at_start_up(tiny_checkpoint_factory):
    """The tiny config has 256 positions: a longer max_model_len failed every long request mid-step."""
    from core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="max_model_len 600 exceeds the 256 positions") as raised:
        make_backend(tiny_checkpoint_factory("llama"), max_model_len=600)
    assert raised.value.param == "max_model_len"


def test_longrope_serves_its_original_context_unless_a_longer_one_is_asked_for(tiny_checkpoint_factory):
    """Phi-3.5's layout: 256 positions extended from 48 by LongRoPE, whose short factors transformers keeps
    only within the 48 (layers/rotary.py): 48 served by default; a longer max_model_len, up to the 256, takes
    the long factors; past the 256 it is refused."""
    from core.errors import InvalidRequestError

    path = tiny_checkpoint_factory("phi3", max_position_embeddings=256, original_max_position_embeddings=48,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.5] * 8, "long_factor": [4.0] * 8})
    assert make_backend(path).model_info.max_model_len == 48
    assert make_backend(path, max_model_len=100).model_info.max_model_len == 100
    with pytest.raises(InvalidRequestError, match="max_model_len 300 exceeds the 256 positions"):
        make_backend(path, max_model_len=300)


async def test_yarn_serves_the_original_context_times_its_factor(tiny_checkpoint_factory):
    """Qwen's long-context recipe: YaRN over a 64-position original, factor 4, max_position_embeddings 64
    (kept): 256 positions; a 180-token prompt and 12 new tokens, all past 64, match transformers."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    path = tiny_checkpoint_factory("qwen3", rope_parameters=rope, max_position_embeddings=64)
    backend = make_backend(path, kv_cache_memory_gib=0.02)
    assert backend.model_info.max_model_len == 256
    engine = AsyncEngine(backend)
    try:
        prompt = [3 + (i * 37) % 250 for i in range(180)]
        response = await collect(engine.generate(prompt, GREEDY))
        assert response.token_ids == reference_greedy(path, prompt, 12)
    finally:
        await engine.close()


def test_a_decoders_dense_projection_is_refused_at_start(tiny_checkpoint_factory, tmp_path):
    """Projections run on the encoders' pooling path only: a decoder embedding checkpoint with a Dense module
    after its pooling would serve other vectors than sentence-transformers', so it does not start."""
    import json
    import shutil

    from core.errors import UnsupportedError

    folder = tmp_path / "decoder-with-dense"
    shutil.copytree(tiny_checkpoint_factory("llama"), folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(UnsupportedError, match="Dense"):
        make_backend(folder)
