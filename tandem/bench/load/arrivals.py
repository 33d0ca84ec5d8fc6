"""When requests are sent: gaps between arrivals, as vLLM's serving benchmark draws them.

At a finite ``rate`` (requests/s) the gaps are gamma-distributed with shape
``burstiness`` and scale ``1 / (rate * burstiness)``: the mean gap is always
``1 / rate``; burstiness 1 is a Poisson process (exponential gaps), below 1 the
arrivals come in bursts (coefficient of variation ``1 / sqrt(burstiness)`` > 1),
above 1 they are more even. An infinite rate sends everything at once, and a
concurrency limit (applied by the runner) then sets the pace.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from tandem.errors import InvalidRequestError


def validate(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise InvalidRequestError("request_rate", f"--request-rate must be > 0, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise InvalidRequestError(
            "burstiness", f"--burstiness must be finite and > 0, got {burstiness}"
        )


def intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` gaps in seconds; the first request waits the first gap (as in vLLM)."""
    validate(rate, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def send_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Offsets from the start of the run at which each of ``n`` requests is sent."""
    return np.cumsum(intervals(n, rate, burstiness, np.random.default_rng(seed)))


def schedule(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Send offsets without end, for runs bounded by a duration."""
    rng = np.random.default_rng(seed)
    now = 0.0
    while True:
        for gap in intervals(1024, rate, burstiness, rng):
            now += float(gap)
            yield now
