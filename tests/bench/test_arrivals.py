"""Arrival schedules: seeded, Poisson by default, everything at once for an infinite rate."""

from __future__ import annotations

import math
import statistics

import pytest

from core.bench.arrivals import arrival_gaps, arrival_times


def test_same_seed_same_schedule_and_other_seed_differs():
    a = list(arrival_gaps(50, 4.0, seed=1))
    assert a == list(arrival_gaps(50, 4.0, seed=1))
    assert a != list(arrival_gaps(50, 4.0, seed=2))


def test_poisson_gaps_have_the_rate_as_mean_and_exponential_spread():
    gaps = list(arrival_gaps(20001, 5.0, seed=0))[1:]
    assert gaps[0] > 0 and min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)  # exponential: std == mean


def test_burstiness_keeps_the_mean_and_changes_the_spread():
    gaps = list(arrival_gaps(20001, 5.0, burstiness=4.0, seed=0))[1:]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.05)  # gamma: std == mean / sqrt(shape)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_times_are_the_running_sum():
    gaps = list(arrival_gaps(10, 2.0, seed=3))
    times = arrival_times(10, 2.0, seed=3)
    assert times[0] == 0.0
    assert times[-1] == pytest.approx(sum(gaps))
    assert times == sorted(times)


@pytest.mark.parametrize(("kwargs", "field"), [({"rate": 0.0}, "request_rate"), ({"rate": -1.0}, "request_rate"),
                                               ({"rate": 1.0, "burstiness": 0.0}, "burstiness"),
                                               ({"rate": 1.0, "count": -1}, "count")])
def test_bad_arguments_name_the_field(kwargs, field):
    args = {"count": 3, **kwargs}
    with pytest.raises(ValueError, match=field):
        list(arrival_gaps(args.pop("count"), args.pop("rate"), **args))
