"""Sampled decoding with speculation keeps the target distribution: a seeded chi-square goodness-of-fit
test of 3-token continuations (top-k 3, so 27 outcomes) on a tiny Llama against the exact probabilities
from transformers on the same weights, with drafts that are sometimes accepted (the greedy continuation)
and sometimes not. The same test runs without speculation as the control; a verifier that always
accepted its drafts fails it (its second token would always be the draft)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core import hookimpl
from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.plugins import get_plugins
from core.response import collect
from core.speculative import Proposer, SpeculativeConfig
from core_pytorch_backend.backend import PytorchBackend

PROMPT = [12, 40, 7, 99, 3, 18]
TOP_K = 3
DRAWS = 1500
N_CHOICES = 10
CHI2_CRITICAL = {26: 54.05, 25: 52.62, 24: 51.18, 23: 49.73, 22: 48.27, 21: 46.80, 20: 45.31}  # p = 0.001


class GreedyTable(Proposer):
    """Proposes, after the prompt and a first token, the greedy next token given them (a table)."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], list[int]] = {}

    def propose(self, requests):
        return [list(self.table.get(tuple(r.token_ids), []))[: r.max_tokens] for r in requests]


@pytest.fixture(scope="module")
def path(tmp_path_factory, make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("spec-sampling"), seed=3)


@pytest.fixture(scope="module")
def exact(path) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under top-k 3 at temperature 1, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def top(context):
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1]
        values, ids = logits.topk(TOP_K)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))

    probs = {}
    for t1, p1 in top(PROMPT).items():
        for t2, p2 in top([*PROMPT, t1]).items():
            for t3, p3 in top([*PROMPT, t1, t2]).items():
                probs[(t1, t2, t3)] = p1 * p2 * p3
    return probs


def chi_square(counts: dict, probs: dict, total: int) -> tuple[float, int]:
    """Pearson's statistic over the outcomes, those expecting fewer than 5 pooled; (statistic, df)."""
    small = [k for k, p in probs.items() if p * total < 5]
    bins = [([k], p) for k, p in probs.items() if k not in small]
    if small:
        bins.append((small, sum(probs[k] for k in small)))
    stat = sum((sum(counts.get(k, 0) for k in keys) - p * total) ** 2 / (p * total) for keys, p in bins)
    assert sum(counts.values()) == total and set(counts) <= set(probs)
    return stat, len(bins) - 1


async def draw(engine: AsyncEngine, first_seed: int) -> dict[tuple[int, ...], int]:
    """DRAWS continuations: requests of N_CHOICES choices (choice i of seed s draws with seed s + i)."""
    config = GenerationConfig(temperature=1.0, top_k=TOP_K, max_new_tokens=3, ignore_eos=True, n=N_CHOICES)
    seeds = range(first_seed, first_seed + DRAWS, N_CHOICES)
    results = await asyncio.gather(*(collect(engine.generate(PROMPT, config.replace(seed=s))) for s in seeds))
    counts: dict[tuple[int, ...], int] = {}
    for choice in (c for r in results for c in r.choices):
        key = tuple(choice.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("speculate", [False, True])
async def test_sampled_tokens_follow_the_target_distribution(path, exact, speculate):
    table = GreedyTable()
    for t1 in {k[0] for k in exact}:  # the likeliest t2 after each t1: accepted often, not always
        best = max((k for k in exact if k[0] == t1), key=lambda k: exact[k])
        table.table[(*PROMPT, t1)] = [best[1]]

    class Plugin:
        @hookimpl
        def core_register_speculative_proposers(self, register):
            register("greedy-table", lambda config: table)

    host = get_plugins()
    name = host.register(Plugin(), name="test-greedy-table")
    spec = SpeculativeConfig("greedy-table", num_speculative_tokens=2) if speculate else None
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gib=0.05,
                                                     speculative=spec, enable_prefix_caching=True)))
    try:
        counts = await draw(engine, 10_000 * speculate)
        stat, df = chi_square(counts, exact, DRAWS)
        print(f"chi-square {stat:.1f} on {df} degrees of freedom")
        assert stat < CHI2_CRITICAL[df], (stat, df, counts)
        if speculate:
            spec_stats = engine.stats().spec_decode
            assert spec_stats.num_draft_tokens == DRAWS  # one draft per request (k = max_tokens - 2)
            assert 0.2 * DRAWS < spec_stats.num_accepted_tokens < 0.95 * DRAWS
    finally:
        await engine.close()
        host.unregister(name)
