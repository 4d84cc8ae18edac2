"""The structured-output mask in the batched sampler: constrained and unconstrained rows in one batch,
logprobs from the model's own distribution, and the xgrammar engine's matcher behind the contract."""

from __future__ import annotations

import asyncio

import torch

from core.structured_output import ConstraintMatcher
from core_pytorch_backend.sampling import SamplingBatch, SamplingParams, SamplingRow, sample


class AllowOnly(ConstraintMatcher):
    """Allows a fixed set of token ids."""

    def __init__(self, *allowed: int) -> None:
        self.allowed, self.accepted = allowed, []

    def fill_bitmask(self, bitmask, row):
        for token in self.allowed:
            bitmask[row, token // 32] |= 1 << (token % 32)

    def accept_token(self, token_id):
        self.accepted.append(token_id)
        return token_id in self.allowed

    def is_terminated(self):
        return False


def test_constrained_rows_sample_only_allowed_tokens_beside_free_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    greedy, sampled = SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, top_p=0.9)
    rows = [SamplingRow(greedy, constraint=AllowOnly(70, 99)), SamplingRow(greedy),
            SamplingRow(sampled, constraint=AllowOnly(33)), SamplingRow(sampled)]
    raw = logits.clone()
    out = sample(logits, SamplingBatch.from_rows(rows))
    expected_first = 70 if logits[0, 70] > logits[0, 99] else 99
    assert out.token_ids[0] == expected_first and out.token_ids[2] == 33
    assert out.token_ids[1] == int(logits[1].argmax())
    assert torch.equal(logits, raw)  # never modified in place
    # logprobs report the model's distribution, not the constrained one
    assert abs(out.logprobs[0].logprob - float(torch.log_softmax(raw[0], -1)[expected_first])) < 1e-5
    assert out.logprobs[0].top[0][0] == int(raw[0].argmax())


def test_a_vocabulary_not_a_multiple_of_32():
    logits = torch.zeros(1, 50)
    out = sample(logits, SamplingBatch.from_rows([SamplingRow(SamplingParams(temperature=0.0),
                                                              constraint=AllowOnly(49))]))
    assert out.token_ids == [49]


class EveryThird(ConstraintMatcher):
    """Token k of the output must be k modulo 3: a matcher with state, which a rebuilt or replayed matcher
    would get wrong."""

    def __init__(self) -> None:
        self.position = 0

    def fill_bitmask(self, bitmask, row):
        for token in range(self.position % 3, bitmask.shape[1] * 32, 3):
            bitmask[row, token // 32] |= 1 << (token % 32)

    def accept_token(self, token_id):
        if token_id % 3 != self.position % 3:
            return False
        self.position += 1
        return True

    def is_terminated(self):
        return False


class EveryThirdEngine:
    def __init__(self, tokenizer, vocab_size):
        pass

    def compile(self, spec):
        from core.structured_output import Constraint

        class Compiled(Constraint):
            def matcher(self, stop_token_ids):
                return EveryThird()

        return Compiled()


async def test_constrained_requests_survive_preemption_and_fork(tiny_checkpoint_factory):
    from core.config import EngineConfig, GenerationConfig
    from core.engine import AsyncEngine
    from core.response import collect
    from core.structured_output import ConstraintCompiler, StructuredOutput
    from core_pytorch_backend.backend import PytorchBackend

    path = str(tiny_checkpoint_factory("qwen2"))
    # 10 blocks of 16 tokens hold about three of these requests: the others are preempted and recomputed.
    backend = PytorchBackend(EngineConfig(model=path, dtype="float32", kv_cache_memory_gib=10 * 8192 / 2**30,
                                          max_model_len=160))
    engine = AsyncEngine(backend, constraints=ConstraintCompiler("every-third", EveryThirdEngine, None, 0))
    config = GenerationConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True,
                              structured_output=StructuredOutput(regex="unused by this engine"))
    try:
        prompts = [[(7 * i + j) % 90 + 3 for j in range(10 + 5 * i)] for i in range(10)]
        results = await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))
        forked = await collect(engine.generate(prompts[0], config.replace(n=3, temperature=1.0, seed=1)))
        for result in [*results, forked]:
            for choice in result.choices:
                assert len(choice.token_ids) == 20
                assert [t % 3 for t in choice.token_ids] == [k % 3 for k in range(20)], choice.token_ids
    finally:
        await engine.close()


async def test_a_constraint_after_a_reasoning_marker_starts_once_the_marker_is_generated(tiny_checkpoint_factory):
    """`Constraint.after(marker)`: each choice is free until its output ends with the marker (one token or
    several), then constrained from the constraint's start; a request the marker never reaches stays free."""
    import dataclasses

    from core.config import EngineConfig, GenerationConfig
    from core.engine import AsyncEngine
    from core.response import collect
    from core.structured_output import ConstraintCompiler, StructuredOutput
    from core_pytorch_backend.backend import PytorchBackend

    path = str(tiny_checkpoint_factory("qwen3"))
    backend = PytorchBackend(EngineConfig(model=path, dtype="float32", max_model_len=128))
    engine = AsyncEngine(backend, constraints=ConstraintCompiler("every-third", EveryThirdEngine, None, 0))
    plain = GenerationConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    constrained = plain.replace(structured_output=StructuredOutput(regex="unused by this engine"))
    prompt = [5, 17, 33, 60, 71, 12, 9]

    async def run(marker: tuple[int, ...], config: GenerationConfig = constrained) -> list[int]:
        prepared = await engine.prepare(prompt, config)
        prepared = dataclasses.replace(prepared, constraint=prepared.constraint.after(marker))
        return list((await collect(engine.generate(prepared))).choices[0].token_ids)

    try:
        free = list((await collect(engine.generate(prompt, plain))).choices[0].token_ids)
        for marker in (free[3:4], free[2:4]):
            end = next(i for i in range(len(free)) if tuple(free[max(0, i + 1 - len(marker)):i + 1]) == tuple(marker))
            out = await run(tuple(marker))
            assert out[:end + 1] == free[:end + 1]  # greedy and unconstrained up to the end of reasoning
            assert [t % 3 for t in out[end + 1:]] == [k % 3 for k in range(len(out) - end - 1)], (marker, out)
        never = (backend.model_info.vocab_size - 1,) * 2
        assert await run(never) == free  # the reasoning never ends: the constraint never applies
        assert (await engine.prepare(prompt, constrained)).constraint.after(()).starts_after == ()
    finally:
        await engine.close()
