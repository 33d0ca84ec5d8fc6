"""Arrival times: the mean rate and the burstiness (gamma shape) are what was asked for."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.bench.load import arrivals
from tandem.errors import InvalidRequestError

N = 20_000


@pytest.mark.parametrize("rate", [0.5, 5.0, 80.0])
def test_poisson_arrivals_have_the_requested_mean_rate_and_cv_one(rate):
    gaps = arrivals.intervals(N, rate, 1.0, np.random.default_rng(1))
    # The standard error of the mean gap is CV / sqrt(N) = 0.7% here; allow 3%.
    assert N / gaps.sum() == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness):
    gaps = arrivals.intervals(N, 10.0, burstiness, np.random.default_rng(2))
    assert N / gaps.sum() == pytest.approx(10.0, rel=0.04)
    # A gamma with shape k has CV 1 / sqrt(k): 2 for k = 0.25 (bursty), 0.5 for k = 4.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_does_not():
    a = arrivals.send_times(100, 3.0, 0.5, seed=7)
    assert np.array_equal(a, arrivals.send_times(100, 3.0, 0.5, seed=7))
    assert not np.array_equal(a, arrivals.send_times(100, 3.0, 0.5, seed=8))
    assert np.all(np.diff(a) >= 0) and a[0] > 0


def test_schedule_without_end_keeps_the_rate():
    it = arrivals.schedule(4.0, 1.0, seed=3)
    offsets = [next(it) for _ in range(3000)]  # crosses several 1024-gap batches
    assert np.all(np.diff(offsets) >= 0)
    assert len(offsets) / offsets[-1] == pytest.approx(4.0, rel=0.06)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrivals.send_times(5, math.inf, 1.0, seed=0), np.zeros(5))


@pytest.mark.parametrize(
    "rate, burstiness, message",
    [(0.0, 1.0, "--request-rate must be > 0, got 0.0"),
     (1.0, 0.0, "--burstiness must be finite and > 0, got 0.0"),
     (1.0, math.inf, "--burstiness must be finite and > 0, got inf")],
)  # fmt: skip
def test_bad_rates_are_refused_with_the_flag_named(rate, burstiness, message):
    with pytest.raises(InvalidRequestError, match=message):
        arrivals.intervals(3, rate, burstiness, np.random.default_rng(0))
