"""StepInterrupt's rule, without a model: a forward pass stops only when every request it may not drop has
an abort queued (or an abort of everything is queued), and an abort that already ran counts no more."""

from __future__ import annotations

import pytest

from core_pytorch_backend.step_interrupt import StepInterrupt, StepInterrupted


def stops(interrupt: StepInterrupt) -> bool:
    try:
        interrupt.check()
    except StepInterrupted:
        return True
    return False


def test_a_step_stops_once_aborts_cover_all_its_requests_whenever_they_were_queued():
    interrupt = StepInterrupt()
    interrupt.aborting(["a"])  # queued while the step was being built
    with interrupt.step({"a", "b"}):
        assert not stops(interrupt)
        interrupt.aborting(["b", "c"])
        assert stops(interrupt)
    assert not stops(interrupt), "the mark ends with the step"


def test_an_abort_that_ran_no_longer_counts():
    interrupt = StepInterrupt()
    interrupt.aborting(["a"])
    interrupt.aborted(["a"])
    with interrupt.step({"a"}):
        assert not stops(interrupt)
    interrupt.aborting(["a"])
    interrupt.aborting(["a"])  # twice (the client's leaving and the engine's abort), one ran
    interrupt.aborted(["a"])
    with interrupt.step({"a"}):
        assert stops(interrupt)


@pytest.mark.parametrize("owners", [set(), {"a"}])
def test_an_abort_of_everything_stops_any_step_and_ids_never_stop_one_without_owners(owners):
    interrupt = StepInterrupt()
    interrupt.aborting(["a", "x"])
    with interrupt.step(owners):  # no owners: only embeddings, whose chunks can run again
        assert stops(interrupt) == bool(owners)
        interrupt.aborting(None)
        assert stops(interrupt)
    interrupt.aborted(None)
    with interrupt.step({"b"}):
        assert not stops(interrupt)
