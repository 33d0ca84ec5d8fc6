"""Reading a process's /metrics: fetch, parse into samples, histogram quantiles.

Used by ``tandem top`` and by the load harness (which saves the servers' metrics
before and after a run). Quantiles are computed from bucket counts the way
PromQL's ``histogram_quantile`` does (linear within the bucket), so ``tandem top``
and a Grafana panel agree on the same data.
"""

from __future__ import annotations

import http.client
import math
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from tandem.errors import TandemError


class ScrapeError(TandemError):
    """A metrics endpoint could not be read."""


class Sample(NamedTuple):
    name: str  # as exposed: with _total, _bucket, _sum, _count
    labels: dict[str, str]
    value: float


def fetch(address: str, timeout: float = 5.0) -> str:
    """The Prometheus text that ``address`` ("host:port") serves on /metrics."""
    url = f"http://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
        list(text_string_to_metric_families(text))  # what is read later must parse
        return text
    except (OSError, http.client.HTTPException, UnicodeDecodeError, ValueError) as exc:
        # (HTTPException: another protocol there, a router's gRPC port say)
        raise ScrapeError(
            f"cannot scrape {url} (is it a metrics port?): {type(exc).__name__}: {exc}"
        ) from exc


def parse(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def declared(text: str) -> set[str]:
    """The metrics that ``text`` declares, samples or not, named as ``METRICS`` names
    them (a counter with its _total)."""
    return {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
    }


def scrape(address: str, timeout: float = 5.0) -> list[Sample]:
    return parse(fetch(address, timeout))


def worker_targets(router: Iterable[Sample]) -> dict[str, Sample]:
    """metrics address -> the router's ``tandem_router_worker_info`` sample for that worker
    (labels: worker (its gRPC address), role, worker_id), for workers that serve metrics."""
    return {
        s.labels["metrics_address"]: s
        for s in router
        if s.name == "tandem_router_worker_info" and s.labels.get("metrics_address")
    }


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def buckets(samples: Iterable[Sample], name: str, **labels: str) -> dict[float, float]:
    """Histogram ``name``'s cumulative bucket counts by upper bound, summed over the
    series whose labels include ``labels``."""
    out: dict[float, float] = defaultdict(float)
    for s in samples:
        if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
            out[float(s.labels["le"])] += s.value
    return dict(out)


def delta(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """Bucket counts observed between two scrapes of the same histogram."""
    return {le: count - before.get(le, 0.0) for le, count in now.items()}


def quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """``histogram_quantile(q, ...)`` over cumulative bucket counts; None with no
    observations. An answer in the +Inf bucket is the largest finite bound."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
