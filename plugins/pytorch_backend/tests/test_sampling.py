"""Tests for the batched sampler (core_pytorch_backend.sampling), CPU only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from core_pytorch_backend import sampling
from core_pytorch_backend.sampling import (
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    apply_logits_processors,
    apply_truncation,
    make_generator,
    sample,
)

lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * 3


def _batch(*rows: SamplingRow) -> SamplingBatch:
    return SamplingBatch.from_rows(list(rows))


def _row(params: SamplingParams, prompt=(), output=(), generator=None, banned=()) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, list(banned))


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_and_takes_the_fast_path(monkeypatch):
    logits = _logits(5)

    def forbidden(*args, **kwargs):
        raise AssertionError("the all-greedy fast path must not sample, sort or compute penalties")

    monkeypatch.setattr(sampling, "_sample_rows", forbidden)
    monkeypatch.setattr(sampling, "_apply_top_k_top_p", forbidden)
    # top_k/top_p on a greedy row are irrelevant: they never remove the argmax.
    rows = [_row(GREEDY), _row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5))] + [_row(GREEDY)] * 3
    batch = _batch(*rows)
    assert not batch.needs_processing
    out = sample(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert out.token_ids_tensor.tolist() == out.token_ids


def test_logits_are_not_modified():
    logits = _logits(3)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={1: 2.0}
    )
    sample(logits, _batch(*[_row(params, [1, 2], [3, 3], banned=[4])] * 3))
    assert torch.equal(logits, before)


def test_greedy_with_repetition_penalty_matches_transformers():
    logits = _logits(4)
    cases = [(1.3, [1, 2, 3], [5, 5]), (0.7, [7, 8], []), (1.0, [9], [10]), (2.0, [], [11, 12, 13, 63])]
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=p), pr, out) for p, pr, out in cases]
    processed = apply_logits_processors(logits, _batch(*rows))
    for i, (penalty, prompt, output) in enumerate(cases):
        ids = torch.tensor([prompt + output], dtype=torch.long)
        expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(processed[i : i + 1], expected)
    out = sample(logits, _batch(*rows))
    assert out.token_ids == processed.argmax(-1).tolist()


def test_repetition_penalty_covers_prompt_and_output_and_ignores_out_of_vocab_ids():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = _row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0, 100], output=[1])
    processed = apply_logits_processors(logits, _batch(row))
    torch.testing.assert_close(processed, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = _logits(3)
    prompt, output = [1, 2, 2], [3, 3, 3, 4, 2]
    rows = [
        _row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt, output),
        _row(SamplingParams(presence_penalty=-1.0), prompt, output),
        _row(SamplingParams(), prompt, output),  # no penalties: row untouched in a penalised batch
    ]
    processed = apply_logits_processors(logits, _batch(*rows))
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()  # output tokens only
    present = (counts > 0).float()
    torch.testing.assert_close(processed[0], logits[0] - 0.25 * counts - 0.5 * present)
    torch.testing.assert_close(processed[1], logits[1] + 1.0 * present)
    torch.testing.assert_close(processed[2], logits[2])


def test_logit_bias_is_added_and_steers_greedy():
    logits = _logits(2)
    params = SamplingParams(temperature=0.0, logit_bias={7: 100.0, 3: -0.5, 0: 1.25})
    batch = _batch(_row(params), _row(GREEDY))
    processed = apply_logits_processors(logits, batch)
    expected = logits[0].clone()
    expected[7] += 100.0
    expected[3] -= 0.5
    expected[0] += 1.25
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], logits[1])
    assert sample(logits, batch).token_ids[0] == 7


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 8)
    logits[0, :3] = 10.0  # the three banned tokens hold nearly all the mass
    params = SamplingParams(temperature=1.5)
    batch = _batch(*[_row(params, banned=[0, 1, 2])] * 2000, _row(GREEDY, banned=[0, 1, 2]))
    tokens = sample(logits.expand(2001, 8).contiguous(), batch).token_ids
    assert not {0, 1, 2} & set(tokens)
    assert len(set(tokens)) > 3  # the remaining tokens are still all reachable


def test_only_allowed_tokens_are_sampled_and_other_rows_are_untouched():
    logits = torch.zeros(1, 8)
    logits[0, :3] = 10.0  # the tokens outside the allowed set hold nearly all the mass
    allowed = SamplingParams(temperature=1.5, allowed_token_ids=(3, 5, 6))
    rows = [_row(allowed)] * 2000 + [_row(SamplingParams(temperature=0.0, allowed_token_ids=(6, 5))), _row(GREEDY)]
    batch = _batch(*rows)
    assert batch.needs_processing
    tokens = sample(logits.expand(2002, 8).contiguous(), batch).token_ids
    assert set(tokens[:2000]) == {3, 5, 6}  # every allowed token reachable, nothing else
    assert tokens[2000] == 5 and tokens[2001] == 0  # greedy: the first of the equal allowed; untouched row
    processed = apply_logits_processors(logits.expand(2, 8), _batch(_row(allowed), _row(GREEDY)))
    assert torch.isinf(processed[0, [0, 1, 2, 4, 7]]).all() and torch.equal(processed[1], logits[0])


def test_allowed_token_ids_come_from_a_generation_config():
    from core import GenerationConfig

    params = SamplingParams.from_config(GenerationConfig(temperature=0.0, allowed_token_ids=[4, 2]))
    assert params.allowed_token_ids == (4, 2)
    assert SamplingParams.from_config(GenerationConfig(temperature=0.0)).allowed_token_ids is None


def test_out_of_vocab_bias_is_an_internal_error():
    batch = _batch(_row(SamplingParams(logit_bias={VOCAB: 1.0})))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(_logits(1), batch)


# ----------------------------------------------------------------------------- truncation masks


def _hf_mask(warper, logits: torch.Tensor) -> torch.Tensor:
    return torch.isinf(warper(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0])


@pytest.mark.parametrize("via_sort", [False, True])  # top-k alone (partial topk) or sharing top-p's sort
@pytest.mark.parametrize("top_k", [1, 5, 63, 64, 1000])
def test_top_k_mask_matches_transformers(top_k, via_sort):
    logits = _logits(3)
    ks = torch.tensor([top_k, 0, top_k])  # 0 = off in the middle row
    top_p_off = torch.zeros(3) if via_sort else None
    masked = apply_truncation(logits, top_k=ks, one_minus_top_p=top_p_off)
    for i in (0, 2):
        expected = _hf_mask(lp.TopKLogitsWarper(min(top_k, VOCAB)), logits[i])
        assert torch.equal(torch.isinf(masked[i]), expected)
    assert not torch.isinf(masked[1]).any()


def test_top_p_mask_matches_transformers():
    top_ps = [0.0, 0.01, 0.3, 0.5, 0.9, 0.999, 1.0]  # 0: the top token alone (OpenAI and HF take it)
    logits = _logits(len(top_ps), seed=1)
    masked = apply_truncation(logits, one_minus_top_p=torch.tensor([1.0 - p for p in top_ps]))
    for i, top_p in enumerate(top_ps):
        expected = _hf_mask(lp.TopPLogitsWarper(top_p), logits[i])
        assert torch.equal(torch.isinf(masked[i]), expected), top_p


def test_top_p_keeps_smallest_set_reaching_p_and_at_least_one_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(4, 4).contiguous()
    # mass 0.5 already reaches 0.5; 0.79 needs two tokens (0.8); 0.81 needs three; tiny p keeps one.
    masked = apply_truncation(logits, one_minus_top_p=torch.tensor([0.5, 0.21, 0.19, 1.0 - 1e-6]))
    kept = (~torch.isinf(masked)).sum(-1).tolist()
    assert kept == [1, 2, 3, 1]


def test_top_k_then_top_p_match_transformers_chain():
    logits = _logits(2, seed=2)
    masked = apply_truncation(logits, torch.tensor([10, 3]), torch.tensor([1.0 - 0.8, 1.0 - 0.95]))
    for i, (k, p) in enumerate([(10, 0.8), (3, 0.95)]):
        ids = torch.zeros(1, 1, dtype=torch.long)
        expected = lp.TopPLogitsWarper(p)(ids, lp.TopKLogitsWarper(k)(ids, logits[i : i + 1].clone()))
        assert torch.equal(torch.isinf(masked[i]), torch.isinf(expected[0]))


def test_min_p_mask_matches_transformers():
    min_ps = [0.0, 0.05, 0.2, 0.9, 1.0]
    logits = _logits(len(min_ps), seed=3)
    masked = apply_truncation(logits, min_p=torch.tensor(min_ps))
    for i, min_p in enumerate(min_ps):
        if min_p == 0.0:
            assert not torch.isinf(masked[i]).any()
            continue
        expected = _hf_mask(lp.MinPLogitsWarper(min_p), logits[i])
        assert torch.equal(torch.isinf(masked[i]), expected), min_p
        assert (~torch.isinf(masked[i])).sum() >= 1


# ----------------------------------------------------------------------------- seeds


def _seeded_tokens(position: int, batch_size: int, steps: int = 5) -> list[int]:
    """Run ``steps`` steps of one seeded request placed at ``position`` among other rows."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    generator = make_generator(1234)
    others = [make_generator(s) for s in range(batch_size)]
    tokens = []
    for step in range(steps):
        logits = _logits(batch_size, seed=100 + step)
        logits[position] = _logits(1, seed=step)[0]  # the seeded request's logits depend only on the step
        rows = []
        for i in range(batch_size):
            if i == position:
                rows.append(_row(params, [1, 2], tokens, generator))
            elif i % 3 == 0:
                rows.append(_row(SamplingParams(temperature=0.8, seed=i), generator=others[i]))
            elif i % 3 == 1:
                rows.append(_row(SamplingParams(temperature=1.3, top_k=5)))
            else:
                rows.append(_row(GREEDY))
        tokens.append(sample(logits, SamplingBatch.from_rows(rows)).token_ids[position])
    return tokens


def test_seeded_request_is_reproducible_across_batch_compositions():
    alone = _seeded_tokens(0, 1)
    assert _seeded_tokens(0, 1) == alone
    for position in (0, 3, 7):
        torch.manual_seed(position)  # unseeded neighbours draw different global noise each time
        assert _seeded_tokens(position, 8) == alone, position
    assert _seeded_tokens(13, 30) == alone


def test_different_seeds_differ_and_generator_advances():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=1)
    gen = make_generator(1)
    first = [sample(logits, _batch(_row(params, generator=gen))).token_ids[0] for _ in range(5)]
    assert len(set(first)) > 1  # the generator moves on each step
    other = [sample(logits, _batch(_row(params, generator=make_generator(2)))).token_ids[0] for _ in range(5)]
    assert first != other


def test_seeded_row_without_generator_is_an_internal_error():
    with pytest.raises(ValueError, match="no generator"):
        _batch(_row(SamplingParams(temperature=1.0, seed=5)))


# ----------------------------------------------------------------------------- distribution


def _expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = logits[None] / params.temperature
    if params.top_k > 0:
        scores = lp.TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = lp.TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0:
        scores = lp.MinPLogitsWarper(params.min_p)(ids, scores)
    return scores.softmax(-1)[0].double()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_k=4),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.15),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05),
    ],
)
def test_sampling_follows_the_truncated_distribution(params):
    torch.manual_seed(0)
    vocab, draws = 8, 20000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    batch = SamplingBatch.from_rows([_row(params)] * draws)
    tokens = sample(logits.expand(draws, vocab).contiguous(), batch).token_ids
    expected = _expected_probs(logits, params)
    observed = _frequencies(tokens, vocab)
    assert torch.all(observed[expected == 0] == 0)
    # 4.5 binomial standard deviations: a false failure is vanishingly rare.
    tolerance = 4.5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-9
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


def test_seeded_draws_over_steps_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=1.0, seed=7)
    gen = make_generator(7)
    batch = _batch(_row(params, generator=gen))
    tokens = [sample(logits, batch).token_ids[0] for _ in range(3000)]
    expected = logits[0].softmax(-1).double()
    assert torch.all((_frequencies(tokens, 4) - expected).abs() < 0.04)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits_of_a_transformers_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7], [8, 9, 10]])).logits[:, -1].float()
    oracle = torch.log_softmax(logits, dim=-1)
    rows = [
        _row(
            SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5, logit_bias={3: 5.0}),
            [5, 6, 7],
        ),
        _row(SamplingParams(temperature=0.7, top_k=10, presence_penalty=1.0, logprobs=20), [8, 9], [10]),
    ]
    out = sample(logits, _batch(*rows))
    for i, k in enumerate((5, 20)):
        entry = out.logprobs[i]
        assert entry is not None and entry.token_id == out.token_ids[i]
        assert abs(entry.logprob - oracle[i, entry.token_id].item()) < 1e-4
        assert len(entry.top) == k
        top_values = [v for _, v in entry.top]
        assert top_values == sorted(top_values, reverse=True)
        for token, value in entry.top:
            assert abs(value - oracle[i, token].item()) < 1e-4
        assert [t for t, _ in entry.top] == oracle[i].topk(k).indices.tolist()


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = _logits(2)
    out = sample(logits, _batch(_row(SamplingParams(temperature=0.0, logprobs=0)), _row(GREEDY)))
    entry = out.logprobs[0]
    assert entry is not None and entry.top == () and out.logprobs[1] is None
    assert math.isclose(entry.logprob, torch.log_softmax(logits[0], -1).max().item(), abs_tol=1e-5)


# ----------------------------------------------------------------------------- mixed batch


def test_mixed_batch_greedy_sampled_and_penalised_rows():
    logits = _logits(6, seed=4)
    config = SimpleNamespace(
        temperature=0.0, top_k=-1, repetition_penalty=1.2, logprobs=2
    )  # GenerationConfig-like
    rows = [
        _row(GREEDY),
        _row(SamplingParams(temperature=0.9, top_k=1)),  # top_k=1 sampling is deterministic
        _row(config, [1, 2, 3], [4]),
        _row(SamplingParams(temperature=1.0, seed=3), generator=make_generator(3), banned=[5]),
        _row(SamplingParams(temperature=0.0, frequency_penalty=2.0, logit_bias={9: 0.3}), [], [9, 9]),
        _row(SamplingParams(temperature=0.5, top_p=1e-6, min_p=0.5)),  # keeps only the top token
    ]
    batch = _batch(*rows)
    processed = apply_logits_processors(logits, batch)
    out = sample(logits, batch)
    argmax = processed.argmax(-1).tolist()
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] == logits[1].argmax().item()
    assert out.token_ids[2] == argmax[2]
    assert out.token_ids[3] != 5
    assert out.token_ids[4] == argmax[4]
    assert out.token_ids[5] == logits[5].argmax().item()
    assert [e is not None for e in out.logprobs] == [False, False, True, False, False, False]
    # Same seeded row alone gives the same token.
    alone = sample(logits[3:4], _batch(_row(rows[3].params, generator=make_generator(3), banned=[5])))
    assert alone.token_ids[0] == out.token_ids[3]


def test_shape_mismatch_is_an_internal_error():
    with pytest.raises(ValueError, match="rows"):
        sample(_logits(3), _batch(_row(GREEDY)))


# ----------------------------------------------------------------------------- fused sampler seam


def test_an_op_sets_sample_kernel_gets_the_sampled_rows_and_the_same_noise():
    """`sample(..., kernel)` hands an op set's fused sampler (the cuda backend's) exactly the rows that
    sample, their parameters and the noise the plain path would use: same seeds, same tokens."""
    calls = []

    def spy(logits, temperature, top_k, one_minus_top_p, min_p, noise):
        calls.append((logits.shape, temperature.tolist(), top_k.tolist() if top_k is not None else None))
        return sampling.sample_tokens(logits, temperature, top_k, one_minus_top_p, min_p, noise)

    def rows():
        return [_row(GREEDY), _row(SamplingParams(temperature=0.7, top_k=5), generator=make_generator(3)),
                _row(SamplingParams(temperature=1.3, top_k=0), generator=make_generator(4))]

    logits = _logits(3)
    plain = sample(logits, _batch(*rows())).token_ids
    fused = sample(logits, _batch(*rows()), spy).token_ids
    assert fused == plain
    assert calls == [(torch.Size([2, VOCAB]), [0.699999988079071, 1.2999999523162842], [5, 0])]
