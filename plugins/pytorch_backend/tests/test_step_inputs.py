"""`narrowed`: the part of a step's inputs and forward outputs that belongs to some of its sequences (what
the engine loop samples again, request by request, when a step's outputs failed)."""

from __future__ import annotations

import torch

from core.scheduling import ScheduledSequence, Sequence
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.step_inputs import PromptRows, StepInputs, StepLogits, narrowed


def chunk(seq_id: str, tokens: int, new: int, drafts: tuple[int, ...] = ()) -> ScheduledSequence:
    seq = Sequence(seq_id, range(tokens))
    seq.num_computed_tokens = tokens - new
    return ScheduledSequence(seq, new, draft_token_ids=drafts)


def test_each_sequence_keeps_its_logits_rows_and_hidden_rows_in_order():
    # a: a decode row; b: a speculating row (its last token and 2 drafts: 3 logits rows); c: a prompt that
    # scores its tokens and samples; d: a pooling prompt (no sampling chunk)
    a, b, c = chunk("a", 9, 1), chunk("b", 12, 3, drafts=(4, 5)), chunk("c", 4, 4)
    logits = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # rows: a | b b b | c
    prompt_hidden = torch.arange(3 * 2, dtype=torch.float32).view(3, 2)  # c's 3 scored positions
    pooling_hidden = torch.arange(6 * 2, dtype=torch.float32).view(6, 2) + 100  # d's 6 positions
    inputs = StepInputs(torch.zeros(14, dtype=torch.int64), torch.zeros(14, dtype=torch.int64),
                        AttentionMetadata.__new__(AttentionMetadata), torch.tensor([0, 1, 2, 3, 7]), [a, b, c],
                        prompt_rows=(PromptRows("c", 4, 0, 3),), pooling_rows=(PromptRows("d", 8, 0, 6),))
    step = StepLogits(logits, prompt_hidden, pooling_hidden)

    only_b, b_step = narrowed(inputs, step, {"b"})
    assert only_b.sampling == [b] and torch.equal(b_step.sample, logits[1:4])
    assert only_b.prompt_rows == () and b_step.prompt_hidden is None and b_step.pooling_hidden is None

    a_and_c, ac_step = narrowed(inputs, step, {"a", "c"})
    assert a_and_c.sampling == [a, c] and torch.equal(ac_step.sample, logits[[0, 4]])
    assert a_and_c.prompt_rows == inputs.prompt_rows and torch.equal(ac_step.prompt_hidden, prompt_hidden)

    only_d, d_step = narrowed(inputs, step, {"d"})
    assert only_d.sampling == [] and d_step.sample.shape == (0, 3)
    assert only_d.pooling_rows == inputs.pooling_rows and torch.equal(d_step.pooling_hidden, pooling_hidden)
    assert only_d.input_ids is inputs.input_ids  # the forward's own inputs are not cut (it has run)


def test_hidden_rows_are_cut_at_each_sequences_offset():
    c, e = chunk("c", 4, 4), chunk("e", 3, 3)
    inputs = StepInputs(torch.zeros(7, dtype=torch.int64), torch.zeros(7, dtype=torch.int64),
                        AttentionMetadata.__new__(AttentionMetadata), torch.tensor([3, 6]), [c, e],
                        prompt_rows=(PromptRows("c", 0, 0, 3), PromptRows("e", 4, 0, 2)))
    hidden = torch.arange(5, dtype=torch.float32).view(5, 1)  # c's 3 rows, then e's 2
    only_e, e_step = narrowed(inputs, StepLogits(torch.zeros(2, 4), hidden), {"e"})
    assert only_e.prompt_rows == (PromptRows("e", 4, 0, 2),) and e_step.prompt_hidden.flatten().tolist() == [3, 4]
