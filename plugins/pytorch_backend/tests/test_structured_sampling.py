"""The structured-output mask in the batched sampler: constrained and unconstrained rows in one batch,
logprobs from the model's own distribution, and the xgrammar engine's matcher behind the contract."""

from __future__ import annotations

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
