"""Speculative decoding in the pytorch backend, on tiny random checkpoints: greedy output with speculation
equals output without it token for token (single and 16 concurrent mixed requests, prefix caching,
chunked prefill, preemption under a tiny KV budget), for the n-gram proposer and for a test-only proposer
that replays the known greedy continuation (long accepted runs, with wrong drafts mixed in); stops and
max_tokens inside an accepted run, logprobs of accepted tokens, n > 1, abort, the per-request opt-out,
and block and session accounting back to idle. The sampled-distribution check is test_speculative_sampling.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from core import hookimpl
from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.plugins import get_plugins
from core.response import Response, collect
from core.speculative import DraftRequest, Proposer, SpeculativeConfig
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
TINY_KV = 10 * 8192 / 2**30  # 10 blocks of 16 tokens for the tiny llama / qwen3 shapes (fp32): preemption


class ReplayProposer(Proposer):
    """Proposes the known greedy continuation of each prompt it was told (`learn`), with every
    `wrong_every`-th proposal's last draft made wrong, so accepted runs are long and partial ones occur."""

    def __init__(self) -> None:
        self.known: list[list[int]] = []  # prompt + greedy output
        self.wrong_every = 3
        self.calls = 0
        self.on_propose = None  # a test's hook, called with the requests

    def learn(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.known.append([*prompt, *output])

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        if self.on_propose is not None:
            self.on_propose(requests)
        return [self._one(r) for r in requests]

    def _one(self, request: DraftRequest) -> list[int]:
        tokens = list(request.token_ids)
        for full in self.known:
            if full[: len(tokens)] == tokens:
                draft = full[len(tokens) : len(tokens) + request.max_tokens]
                self.calls += 1
                if draft and self.calls % self.wrong_every == 0:
                    draft[-1] = (draft[-1] + 1) % 250
                return draft
        return []


class ReplayPlugin:
    def __init__(self) -> None:
        self.proposer = ReplayProposer()

    @hookimpl
    def core_register_speculative_proposers(self, register):
        register("replay", lambda config: self.proposer)


@pytest.fixture
def replay():
    host = get_plugins()
    plugin = ReplayPlugin()
    name = host.register(plugin, name="test-replay-proposer")
    yield plugin.proposer
    host.unregister(name)


def make_engine(path, spec: SpeculativeConfig | None = None, **options) -> AsyncEngine:
    options = {"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}
    return AsyncEngine(PytorchBackend(EngineConfig(model=str(path), speculative=spec, **options)))


def mixed_prompts(count: int) -> list[list[int]]:
    """Prompts of different lengths sharing prefixes (prefix-cache hits), some repeating themselves
    (n-gram matches)."""
    shared = [(13 * j + 5) % 250 for j in range(40)]
    prompts = []
    for i in range(count):
        own = [(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 29)]
        prompts.append((shared[: 8 * (i % 4)] + own + own[: i % 7])[:70])
    return prompts


def mixed_configs(count: int) -> list[GenerationConfig]:
    """Greedy configs of different lengths; some with logprobs, one opted out of speculation."""
    configs = []
    for i in range(count):
        config = GREEDY.replace(max_new_tokens=8 + (7 * i) % 23)
        if i % 5 == 1:
            config = config.replace(logprobs=True, top_logprobs=2)
        if i == 3:
            config = config.replace(speculative=False)
        configs.append(config)
    return configs


async def run_all(engine: AsyncEngine, prompts, configs) -> list[Response]:
    return await asyncio.gather(*(collect(engine.generate(p, c)) for p, c in zip(prompts, configs, strict=True)))


def outcome(response: Response) -> list[tuple]:
    return [(c.token_ids, c.finish_reason) for c in response.choices]


async def expected_outcomes(path, prompts, configs, **options) -> list[Response]:
    plain = make_engine(path, **options)
    try:
        return await run_all(plain, prompts, configs)
    finally:
        await plain.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "replay"])
async def test_greedy_with_speculation_equals_without(tiny_checkpoint_factory, replay, arch, method):
    path = tiny_checkpoint_factory(arch)
    prompts, configs = mixed_prompts(16), mixed_configs(16)
    options = {"max_num_batched_tokens": 48}  # chunked prefill
    expected = await expected_outcomes(path, prompts, configs, **options)
    for prompt, response in zip(prompts, expected, strict=True):
        replay.learn(prompt, response.token_ids)
    engine = make_engine(path, SpeculativeConfig(method, num_speculative_tokens=5, ngram_min=1, ngram_max=3),
                         **options)
    try:
        single = await collect(engine.generate(prompts[6], configs[6]))
        assert outcome(single) == outcome(expected[6])
        together = await run_all(engine, prompts, configs)
        for i, (got, want) in enumerate(zip(together, expected, strict=True)):
            assert outcome(got) == outcome(want), i
        stats = await wait_idle(engine)
        assert_idle(engine, stats)
        assert stats.spec_decode.num_draft_tokens > 0
        if method == "replay":  # long accepted runs
            assert stats.spec_decode.num_accepted_tokens > 0.5 * stats.spec_decode.num_draft_tokens
            assert max(i for i, n in enumerate(stats.spec_decode.accepted_per_position) if n) == 4
    finally:
        await engine.close()


def count_preemptions(engine: AsyncEngine) -> list[str]:
    """The ids of the sequences the engine's scheduler preempts from now on (it wraps `schedule`)."""
    scheduler, preempted = engine.backend.loop.scheduler, []
    schedule = scheduler.schedule

    def counting(*args, **kwargs):
        out = schedule(*args, **kwargs)
        preempted.extend(seq.seq_id for seq in out.preempted)
        return out

    scheduler.schedule = counting
    return preempted


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "replay"])
async def test_preemption_under_a_tiny_kv_budget_keeps_greedy_output(tiny_checkpoint_factory, replay, arch, method):
    path = tiny_checkpoint_factory(arch)
    prompts, configs = mixed_prompts(12), [GREEDY.replace(max_new_tokens=20)] * 12
    options = {"kv_cache_memory_gib": TINY_KV, "max_model_len": 160}
    expected = await expected_outcomes(path, prompts, configs)
    for prompt, response in zip(prompts, expected, strict=True):
        replay.learn(prompt, response.token_ids)
    engine = make_engine(path, SpeculativeConfig(method, num_speculative_tokens=4), **options)
    try:
        assert engine.stats().kv_blocks_total == 10
        preempted = count_preemptions(engine)
        got = await run_all(engine, prompts, configs)
        assert [outcome(r) for r in got] == [outcome(r) for r in expected]
        assert preempted
        stats = await wait_idle(engine)
        assert_idle(engine, stats)
        assert stats.spec_decode.num_accepted_tokens > 0
    finally:
        await engine.close()


async def test_a_stop_id_and_max_tokens_inside_an_accepted_run(tiny_checkpoint_factory, replay):
    path = tiny_checkpoint_factory("llama")
    prompt = [5, 9, 2, 7, 4, 1, 8]
    plain = make_engine(path)
    try:
        full = (await collect(plain.generate(prompt, GREEDY.replace(max_new_tokens=30)))).token_ids
        stop_at = next(i for i in range(6, 30) if full[i] not in full[:i])  # its first occurrence
        stopped = GREEDY.replace(max_new_tokens=30, stop_token_ids=(full[stop_at],))
        want_stop = await collect(plain.generate(prompt, stopped))
        want_length = await collect(plain.generate(prompt, GREEDY.replace(max_new_tokens=11)))
    finally:
        await plain.close()
    assert want_stop.token_ids == full[: stop_at + 1]
    replay.learn(prompt, full)
    replay.wrong_every = 10**9  # every draft right: runs of 8 cross the stop and the limit
    engine = make_engine(path, SpeculativeConfig("replay", num_speculative_tokens=8))
    try:
        got_stop = await collect(engine.generate(prompt, stopped))
        assert outcome(got_stop) == outcome(want_stop) and got_stop.choices[0].finish_reason == "stop"
        got_length = await collect(engine.generate(prompt, GREEDY.replace(max_new_tokens=11)))
        assert outcome(got_length) == outcome(want_length) and len(got_length.token_ids) == 11
        stats = await wait_idle(engine)
        assert_idle(engine, stats)
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    finally:
        await engine.close()


async def test_logprobs_of_accepted_tokens_equal_plain_decoding(tiny_checkpoint_factory, replay):
    path = tiny_checkpoint_factory("qwen3")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    config = GREEDY.replace(max_new_tokens=16, logprobs=True, top_logprobs=3)
    plain = make_engine(path)
    try:
        want = await collect(plain.generate(prompt, config))
    finally:
        await plain.close()
    replay.learn(prompt, want.token_ids)
    engine = make_engine(path, SpeculativeConfig("replay", num_speculative_tokens=4))
    try:
        got = await collect(engine.generate(prompt, config))
        assert got.token_ids == want.token_ids
        for a, b in zip(got.choices[0].logprobs, want.choices[0].logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert engine.stats().spec_decode.num_accepted_tokens > 0
    finally:
        await engine.close()


async def test_n_choices_and_seeded_sampling_speculate(tiny_checkpoint_factory, replay):
    path = tiny_checkpoint_factory("llama")
    prompt = [(5 * j) % 250 for j in range(20)]
    greedy_n = GREEDY.replace(n=3, max_new_tokens=12)
    plain = make_engine(path)
    try:
        want = await collect(plain.generate(prompt, greedy_n))
    finally:
        await plain.close()
    replay.learn(prompt, want.choices[0].token_ids)
    engine = make_engine(path, SpeculativeConfig("replay", num_speculative_tokens=3))
    try:
        got = await collect(engine.generate(prompt, greedy_n))
        assert outcome(got) == outcome(want)
        seeded = GenerationConfig(temperature=1.0, seed=11, n=2, max_new_tokens=12, ignore_eos=True)
        first = await collect(engine.generate(prompt, seeded))
        again = await collect(engine.generate(prompt, seeded))  # the same composition: alone
        assert outcome(first) == outcome(again)
        assert_idle(engine, await wait_idle(engine))
        assert engine.stats().spec_decode.num_drafts > 0
    finally:
        await engine.close()


async def test_speculative_false_opts_a_request_out(tiny_checkpoint_factory, replay):
    path = tiny_checkpoint_factory("llama")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    engine = make_engine(path, SpeculativeConfig("replay"))
    try:
        plain = await collect(engine.generate(prompt, GREEDY.replace(max_new_tokens=8, speculative=False)))
        replay.learn(prompt, plain.token_ids)
        again = await collect(engine.generate(prompt, GREEDY.replace(max_new_tokens=8, speculative=False)))
        assert engine.stats().spec_decode.num_drafts == 0 and again.token_ids == plain.token_ids
        speculated = await collect(engine.generate(prompt, GREEDY.replace(max_new_tokens=8)))
        assert engine.stats().spec_decode.num_drafts > 0 and speculated.token_ids == plain.token_ids
    finally:
        await engine.close()


async def test_an_abort_during_a_verifying_step_frees_everything(tiny_checkpoint_factory, replay):
    path = tiny_checkpoint_factory("llama")
    prompts = mixed_prompts(4)
    engine = make_engine(path, SpeculativeConfig("replay", num_speculative_tokens=4))
    loop = engine.backend.loop
    config = GREEDY.replace(max_new_tokens=60)
    for prompt, response in zip(prompts, await run_all(engine, prompts, [config.replace(speculative=False)] * 4),
                                strict=True):
        replay.learn(prompt, response.token_ids)

    def abort_while_verifying(requests):  # queued now, it runs right after this verifying step
        if replay.calls > 6:
            for session_id in {r.seq_id.split("#")[0] for r in requests}:
                loop.call(lambda sid=session_id: loop.abort(sid))

    replay.on_propose = abort_while_verifying
    try:
        results = await run_all(engine, prompts, [config] * len(prompts))
        assert any(r.choices[0].finish_reason == "abort" for r in results)
        assert_idle(engine, await wait_idle(engine))
        assert engine.stats().spec_decode.num_drafts > 0
    finally:
        await engine.close()


def test_an_unknown_proposer_stops_start_up(tiny_checkpoint_factory):
    from core.errors import PluginError

    with pytest.raises(PluginError, match="draft, ngram"):
        make_engine(tiny_checkpoint_factory("llama"), SpeculativeConfig("eagle"))
