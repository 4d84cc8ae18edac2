"""layers/recurrent.py: a step's sequences as runs of rows, state slots read (zero for a fresh sequence, whatever
the slot holds) and written, the depthwise causal convolution across chunks and decode steps, and the states'
allocation, growth and fork copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers.recurrent import (
    RecurrentLayer,
    StateSpec,
    allocate_recurrent_states,
    causal_conv1d,
    copy_state_slots,
    initial_states,
    segments,
    state_bytes_per_sequence,
    store_states,
)


def meta(computed, new, slots):
    return AttentionMetadata.build(computed, new, [[0] * 8] * len(new), 4, state_slots=slots)


def test_a_sequences_consecutive_rows_are_one_run_and_empty_rows_none():
    # a recomputed sequence (slot 5): its prompt row, then one row per generated token; then another sequence
    step = meta([0, 6, 7, 3, 0], [6, 1, 1, 0, 2], [5, 5, 5, 1, 2])
    runs = segments(step)
    assert [(s.start, s.length, s.slot, s.fresh) for s in runs] == [(0, 8, 5, True), (8, 2, 2, True)]
    assert segments(step) is runs  # once a step


def test_fresh_segments_read_zero_from_a_slot_full_of_nan_and_stores_land_in_their_slots():
    state = torch.full((4, 2, 3), float("nan"))
    state[1] = 7.0
    runs = segments(meta([0, 4], [2, 1], [3, 1]))
    init = initial_states(state, runs)
    assert torch.equal(init[0], torch.zeros(2, 3)) and torch.equal(init[1], torch.full((2, 3), 7.0))
    store_states(state, runs, torch.stack([torch.ones(2, 3), torch.full((2, 3), 2.0)]))
    assert torch.equal(state[3], torch.ones(2, 3)) and torch.equal(state[1], torch.full((2, 3), 2.0))
    assert state[0].isnan().all() and state[2].isnan().all()


def _whole_conv(x, weight, bias):
    channels, taps = weight.shape
    return F.conv1d(F.pad(x.t()[None], (taps - 1, 0)), weight[:, None], bias, groups=channels)[0].t()


def test_causal_conv_over_uneven_chunks_and_decode_steps_equals_the_whole_sequences_conv():
    gen = torch.Generator().manual_seed(0)
    channels, taps = 6, 4
    weight, bias = torch.randn(channels, taps, generator=gen), torch.randn(channels, generator=gen)
    inputs = [torch.randn(n, channels, generator=gen) for n in (11, 6, 5)]
    conv_state = torch.full((5, channels, taps - 1), float("nan"))
    slots, done = [3, 0, 4], [0, 0, 0]
    got = [[] for _ in inputs]
    # chunks shorter than the kernel, an idle sequence, then two decode steps (one row each, batched)
    for piece in [(1, 1, 1), (5, 2, 0), (3, 1, 2), (1, 1, 1), (1, 1, 1)]:
        rows = [x[d : d + n] for x, d, n in zip(inputs, done, piece, strict=True)]
        out = causal_conv1d(torch.cat(rows), weight, bias, conv_state, segments(meta(done, list(piece), slots)))
        for i, part in enumerate(out.split(list(piece))):
            got[i].append(part)
            done[i] += piece[i]
    for x, parts in zip(inputs, got, strict=True):
        torch.testing.assert_close(torch.cat(parts), _whole_conv(x, weight, bias))


class _Layer(RecurrentLayer):
    def state_specs(self):
        return (StateSpec((2, 3)), StateSpec((4,), torch.float32))


def test_states_grow_keeping_what_they_hold_and_forks_copy_a_slot():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16), _Layer(), _Layer())
    assert state_bytes_per_sequence(model, torch.bfloat16) == 2 * (6 * 2 + 4 * 4)
    first = allocate_recurrent_states(model, 2)
    assert [s.dtype for s in first[0]] == [torch.bfloat16, torch.float32]
    first[1][1][1] = 3.0
    grown = allocate_recurrent_states(model, 5, keep=first)
    assert grown[1][1].shape == (5, 4) and torch.equal(grown[1][1][1], torch.full((4,), 3.0))
    assert model[2].states is grown[1]
    copy_state_slots(model, [(1, 4)])
    assert torch.equal(model[2].states[1][4], torch.full((4,), 3.0))
