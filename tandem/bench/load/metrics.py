"""Per-request timings and the summary, defined as vLLM's serving benchmark defines them.

For one request, with times taken on the client (``time.perf_counter``) from the
moment it was sent:
- TTFT: until the first streamed response that carries a token;
- E2E: until the last response;
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, for requests with > 1 output token;
- ITL: every gap between consecutive streamed responses that carry tokens. A
  response may carry more than one token (the decode worker sends what it has), so
  an ITL can span several tokens; TPOT is the per-token figure.

Over a run lasting ``duration`` (first send to last response): request throughput
is completed requests / duration; output (total) token throughput is the completed
requests' output (prompt + output) tokens, as the server reports them in ``usage``,
/ duration. A request is *good* when it completed and meets every SLO given (TPOT
is not defined for one-token outputs and then counts as met); goodput is good
requests / duration, and SLO attainment is good requests / all measured requests
(failed ones count as misses).

Failure bursts: a run whose failures of one status cluster in time (every request
failing from some point on, say, as when a server wrongly takes its only worker
for dead) measures a failure storm, not capacity: its throughput is that of fast
failures. ``failure_bursts`` finds them, for the summary to say so.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    send_time: float  # s after the run started
    input_len: int | None  # expected prompt tokens (None: not counted before sending)
    output_len: int  # max_tokens asked for
    chunk_times: list[float] = field(default_factory=list)  # s after send, per response
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each response
    prompt_tokens: int = 0  # usage, from the last response
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # gRPC status name when the call failed
    error_detail: str = ""  # the server's message with it (or the exception's)
    end_time: float | None = None  # s after send when the call ended (failed ones too)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def token_times(self) -> list[float]:
        """Arrival times of the responses that carried tokens."""
        return [t for t, k in zip(self.chunk_times, self.chunk_tokens, strict=True) if k > 0]

    @property
    def ttft(self) -> float | None:
        times = self.token_times
        return times[0] if self.ok and times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] if self.ok and self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.token_times if self.ok else []
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass(frozen=True)
class Stats:
    """Milliseconds; NaN when there was nothing to measure."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(seconds) * 1e3
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # gRPC status name -> count
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    max_concurrency_seen: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo: SLO
    good_requests: int
    goodput: float  # good requests / s
    slo_attainment: float  # good / all measured requests
    bursts: list[Burst] = field(default_factory=list)
    # Completed requests a second from the first completion to the last ((n - 1) /
    # span): the rate the server kept up, without the run's ramp-up and drain that
    # request_throughput counts; nan below 2 completions.
    completion_rate: float = math.nan
    # The first message each status in ``errors`` came with: a count alone did not say
    # why every request failed (a refused setting, say).
    error_details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Burst:
    """``failed`` of ``ended`` requests that ended between ``start_s`` and ``end_s`` (s
    after the run started) failed with ``status``: most of that status's failures."""

    status: str
    start_s: float
    end_s: float
    failed: int
    ended: int

    def describe(self) -> str:
        return (
            f"{self.failed} {self.status} of {self.ended} requests ending "
            f"{self.start_s:.1f}-{self.end_s:.1f} s: a failure burst, not capacity"
        )


# A burst: at least this many failures of one status, at least this share of that
# status's failures, in a stretch where at least this share of the requests failed so.
BURST_MIN_FAILURES = 5
BURST_SHARE_OF_STATUS = 0.5
BURST_MIN_FAILED_SHARE = 0.8


def failure_bursts(records: list[RequestRecord]) -> list[Burst]:
    """For each failure status, the stretch of the run (in order of when requests ended)
    where its failures most outnumber everything else (a maximum-sum run of +1 for
    such a failure, -1 for any other outcome); reported when it is a burst (above)."""
    ended = sorted((r for r in records if r.end_time is not None),
                   key=lambda r: r.send_time + r.end_time)  # fmt: skip
    bursts = []
    for status, total in sorted(Counter(r.error for r in ended if r.error).items()):
        best, best_span, run, run_start = 0, (0, -1), 0, 0
        for i, r in enumerate(ended):
            if run <= 0:
                run, run_start = 0, i
            run += 1 if r.error == status else -1
            if run > best:
                best, best_span = run, (run_start, i)
        span = ended[best_span[0] : best_span[1] + 1]
        failed = sum(r.error == status for r in span)
        if (failed >= BURST_MIN_FAILURES and failed >= BURST_SHARE_OF_STATUS * total
                and failed >= BURST_MIN_FAILED_SHARE * len(span)):  # fmt: skip
            first, last = span[0], span[-1]
            bursts.append(Burst(status, first.send_time + first.end_time,
                                last.send_time + last.end_time, failed, len(span)))  # fmt: skip
    return bursts


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> Summary:
    done = [r for r in records if r.ok]
    errors = Counter(r.error or "INCOMPLETE" for r in records if not r.ok)
    details: dict[str, str] = {}
    for r in records:
        if not r.ok and r.error_detail:
            details.setdefault(r.error or "INCOMPLETE", r.error_detail)
    good = sum(slo.met(r) for r in records)
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else math.nan

    return Summary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        errors=dict(sorted(errors.items())),
        error_details=dict(sorted(details.items())),
        duration_s=duration_s,
        input_tokens=inputs,
        output_tokens=outputs,
        request_throughput=rate(len(done)),
        output_throughput=rate(outputs),
        total_token_throughput=rate(inputs + outputs),
        max_concurrency_seen=max_in_flight(records),
        ttft_ms=Stats.of([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=Stats.of([r.tpot for r in done if r.tpot is not None]),
        itl_ms=Stats.of([g for r in done for g in r.itls]),
        e2e_ms=Stats.of([r.e2e for r in done]),
        slo=slo,
        good_requests=good,
        goodput=rate(good),
        slo_attainment=good / len(records) if records else math.nan,
        bursts=failure_bursts(records),
        completion_rate=completion_rate(done),
    )


def completion_rate(done: list[RequestRecord]) -> float:
    """(completions - 1) / (last completion - first completion), completions a second."""
    ends = sorted(r.send_time + r.e2e for r in done if r.e2e is not None)
    span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    return (len(ends) - 1) / span if span > 0 else math.nan


def max_in_flight(records: list[RequestRecord]) -> int:
    """The most requests open at once, failed ones included: each from its send to the
    call's end (its last response where the end was not recorded)."""
    events = []
    for r in records:
        end = r.end_time if r.end_time is not None else (r.chunk_times or [None])[-1]
        if end is not None:
            events += [(r.send_time, 1), (r.send_time + end, -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak
