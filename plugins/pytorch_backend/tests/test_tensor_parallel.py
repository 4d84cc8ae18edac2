"""Tensor parallelism end to end on the CPU (gloo): two ranks give the single-rank engine's greedy
outputs on tiny Llama and Qwen3 checkpoints (float32) with 8 concurrent requests, the prefix cache on,
chunked prefill and preemption, and on int8 codes packed at load; seeds, n > 1, logprobs, prompt logprobs
and embeddings agree; abort, sleep and wakeup reach every rank; a killed rank fails the requests in
flight and the health check, and nothing hangs; a rank that fails to load is a start-up error. Every
rank's process is gone once the backend is closed.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import BackendError
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SHARED = [(13 * j + 5) % 250 for j in range(40)]  # a prefix every prompt starts with: prefix-cache hits
BLOCK_BYTES_PER_RANK = 2 * 2 * 16 * 1 * 16 * 4  # layers x (K, V) x tokens x KV heads per rank x dims x fp32


def prompts(count: int = 8) -> list[list[int]]:
    return [SHARED[: 8 + 4 * i] + [(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 29)]
            for i in range(count)]


def backend(path, tp: int, **options) -> PytorchBackend:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, "max_num_batched_tokens": 64, **options}
    return PytorchBackend(EngineConfig(model=str(path), tensor_parallel_size=tp, **options))


def close(backend: PytorchBackend) -> None:
    """Close `backend` and check that its ranks' processes are gone."""
    asyncio.run(backend.close())
    if backend.tp is not None and backend.tp.runner is not None:
        assert backend.tp.runner.ranks.alive == [], "a rank's process outlived the backend"


async def generate_all(engine: AsyncEngine, config=GREEDY, count: int = 8):
    return await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts(count)))


@pytest.fixture(scope="module")
def llama(tiny_checkpoint_factory):
    """(one rank, two ranks) on the tiny Llama; the two ranks' cache is 10 blocks: 8 requests preempt."""
    path = tiny_checkpoint_factory("llama")
    single = backend(path, 1)
    tight = backend(path, 2, kv_cache_memory_gib=10 * BLOCK_BYTES_PER_RANK / 2**30, max_model_len=96)
    yield single, tight
    close(tight)
    close(single)


async def test_greedy_outputs_match_one_rank_with_preemption_and_prefix_hits(llama):
    single, tp = AsyncEngine(llama[0]), AsyncEngine(llama[1])
    assert tp.stats().kv_blocks_total == 10
    expected = [r.token_ids for r in await generate_all(single)]
    hits = tp.stats().prefix_cache_hits
    assert [r.token_ids for r in await generate_all(tp)] == expected
    assert tp.stats().prefix_cache_hits > hits  # the shared prefix's blocks
    assert_idle(tp, await wait_idle(tp))


async def test_seeds_n_choices_logprobs_and_embeddings_match_one_rank(llama):
    single, tp = AsyncEngine(llama[0]), AsyncEngine(llama[1])
    seeded = GenerationConfig(temperature=1.0, top_p=0.9, seed=1234, n=3, max_new_tokens=8, ignore_eos=True)
    scored = GREEDY.replace(logprobs=True, top_logprobs=3, prompt_logprobs=2, max_new_tokens=4)
    for config in (seeded, scored):
        want = await collect(single.generate(prompts()[3], config))
        got = await collect(tp.generate(prompts()[3], config))
        assert [c.token_ids for c in got.choices] == [c.token_ids for c in want.choices]
    for mine, theirs in zip(got.choices[0].logprobs, want.choices[0].logprobs, strict=True):
        assert abs(mine.logprob - theirs.logprob) < 1e-4
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    for mine, theirs in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert abs(mine.logprob - theirs.logprob) < 1e-4
    vectors = await asyncio.gather(llama[0].embed(prompts(2)), llama[1].embed(prompts(2)))
    assert torch.allclose(torch.tensor(vectors[1]), torch.tensor(vectors[0]), atol=1e-5)
    assert_idle(tp, await wait_idle(tp))


async def test_an_abort_mid_stream_frees_every_rank_and_serving_goes_on(llama):
    tp = AsyncEngine(llama[1])
    stream = tp.generate(prompts()[0], GREEDY.replace(max_new_tokens=80))
    await stream.__anext__()
    await tp.abort(stream.session_id)
    async for _ in stream:
        pass
    assert_idle(tp, await wait_idle(tp))
    assert (await collect(tp.generate(prompts()[1], GREEDY))).finish_reason == "length"


async def test_sleep_and_wakeup_free_and_restore_every_rank(llama):
    single, tp = AsyncEngine(llama[0]), AsyncEngine(llama[1])
    expected = (await collect(single.generate(prompts()[2], GREEDY))).token_ids
    for level in (1, 2):
        await tp.sleep(level)
        assert tp.is_sleeping and llama[1].loop.asleep == {"kv_cache", "weights"}
        await tp.wakeup(["weights"])
        await tp.wakeup(["kv_cache"])
        assert not tp.is_sleeping
        assert (await collect(tp.generate(prompts()[2], GREEDY))).token_ids == expected
    assert_idle(tp, await wait_idle(tp))


async def test_qwen3_greedy_outputs_match_one_rank(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3")
    single, tp = backend(path, 1), backend(path, 2)
    try:
        expected = [r.token_ids for r in await generate_all(AsyncEngine(single))]
        assert [r.token_ids for r in await generate_all(AsyncEngine(tp))] == expected
    finally:
        await asyncio.to_thread(close, tp)
        await asyncio.to_thread(close, single)


async def test_packed_int8_shards_match_one_rank(tiny_checkpoint_factory):
    """Load-time int8 codes, packed for the native kernel (or torch's) on every rank: rank 0's kernel and
    dtype are the others' too, and the row-parallel layers' codes are cut on whole groups of 32 inputs."""
    path = tiny_checkpoint_factory("llama")
    single, tp = backend(path, 1, quantization="int8"), backend(path, 2, quantization="int8")
    try:
        assert "int8" in tp.model_info.quantization
        expected = [r.token_ids for r in await generate_all(AsyncEngine(single), count=4)]
        assert [r.token_ids for r in await generate_all(AsyncEngine(tp), count=4)] == expected
    finally:
        await asyncio.to_thread(close, tp)
        await asyncio.to_thread(close, single)


async def test_an_int8_kv_cache_on_every_rank_matches_one_rank(tiny_checkpoint_factory):
    """--kv-cache-dtype int8 reaches every rank (WorkerSpec.kv_cache_dtype); a cache row is one KV head's, so
    each rank's shard of the heads quantizes its rows as one rank does."""
    path = tiny_checkpoint_factory("llama")
    int8 = {"backend_options": {"kv_cache_dtype": "int8"}}
    single, tp = backend(path, 1, **int8), backend(path, 2, **int8)
    try:
        assert tp.loop.runner.local.kv_cache_dtype == torch.uint8
        expected = [r.token_ids for r in await generate_all(AsyncEngine(single), count=4)]
        assert [r.token_ids for r in await generate_all(AsyncEngine(tp), count=4)] == expected
    finally:
        await asyncio.to_thread(close, tp)
        await asyncio.to_thread(close, single)


async def test_a_killed_rank_fails_the_requests_and_the_health_check_without_hanging(tiny_checkpoint_factory):
    tp = backend(tiny_checkpoint_factory("llama"), 2)
    engine = AsyncEngine(tp)
    try:
        streams = [engine.generate(p, GREEDY.replace(max_new_tokens=140)) for p in prompts(4)]
        for stream in streams:
            await stream.__anext__()
        tp.tp.runner.ranks.processes[1].kill()
        started = time.monotonic()
        for stream in streams:
            with pytest.raises(BackendError, match="tensor-parallel rank 1 of 2 died"):
                async for _ in stream:
                    pass
        assert time.monotonic() - started < 30
        with pytest.raises(BackendError, match="rank 1"):
            engine.stats()  # what /health and the server's watchdog read: 503, then exit status 1
        with pytest.raises(BackendError, match="rank 1"):
            await collect(engine.generate(prompts()[0], GREEDY))
    finally:
        started = time.monotonic()
        await asyncio.to_thread(close, tp)
        assert time.monotonic() - started < 30


def test_a_size_the_model_cannot_split_stops_start_up_before_any_rank_starts(tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's 4 attention"):
        backend(tiny_checkpoint_factory("llama"), 3)


def test_a_rank_that_fails_to_load_is_a_clear_start_up_error_and_leaves_no_process(tiny_checkpoint_factory,
                                                                                     monkeypatch):
    from core_pytorch_backend.distributed import supervisor

    spawned = []
    real_spawn = supervisor._spawn
    monkeypatch.setattr(supervisor, "_spawn", lambda spec: spawned.append(real_spawn(spec)) or spawned[-1])
    monkeypatch.setattr(supervisor, "WORKER_COMMAND", (
        "import core_pytorch_backend.distributed.worker as w\n"
        "def load(self): raise MemoryError('no room for the shard')\n"
        "w.RankWorker.load = load\nw.main()"))
    threads = torch.get_num_threads()
    with pytest.raises(BackendError, match="start-up failed: rank 1: MemoryError: no room for the shard"):
        backend(tiny_checkpoint_factory("llama"), 2)
    assert [p.poll() for p in spawned] != [None] and torch.get_num_threads() == threads
