"""Admission: at most ``max_queue`` requests in flight through the router, and per
API key at most its ``max_streams`` of them and its ``requests_per_s`` (callers by
client certificate alone, on a router without keys, share one such key's limits).

A Generate or Tokenize call is admitted after the checks that need no tokenizer
and holds its slots (the key's and the router's) until it ends for any reason.
Beyond a bound the answer is RESOURCE_EXHAUSTED at once: overload is never
queued without bound (see LESSONS.md). The message names the bound, and for a
key its name, never the key; the other keys are still served.

The rate is a token bucket per key, refilled at ``requests_per_s`` up to a burst
of max(1, rate), taken from by every call of the public service (GetModelInfo
included) before anything else is done for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.router.auth import ApiKey
from tandem.router.errors import RouterError


class TokenBucket:
    def __init__(self, rate: float, clock=time.monotonic) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self._clock = clock
        self._last = clock()

    def take(self) -> float:
        """Takes a call: 0.0, or the seconds until one may be taken (nothing taken)."""
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = now
        if self.tokens < 1:
            return (1 - self.tokens) / self.rate
        self.tokens -= 1
        return 0.0


@dataclass
class _KeyState:
    max_streams: int  # 0: no limit
    bucket: TokenBucket | None  # None: no rate limit
    in_flight: int = 0


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        key_max_streams: int = 0,
        key_requests_per_s: float = 0.0,
        clock=time.monotonic,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.key_max_streams = key_max_streams
        self.key_requests_per_s = key_requests_per_s
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        # Whose limits a call without a key is under (None: none; the router sets
        # auth.CERTIFICATE_CALLERS where client certificates alone authenticate).
        self.keyless: ApiKey | None = None

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._keys.get(key.name)
        if state is None:
            streams = self.key_max_streams if key.max_streams is None else key.max_streams
            rate = self.key_requests_per_s if key.requests_per_s is None else key.requests_per_s
            bucket = TokenBucket(rate, self._clock) if rate > 0 else None
            state = self._keys[key.name] = _KeyState(streams, bucket)
        return state

    def check_rate(self, key: ApiKey | None) -> None:
        """Takes one call from ``key``'s bucket (RESOURCE_EXHAUSTED when it is empty)."""
        key = key or self.keyless
        if key is None:
            return
        bucket = self._state(key).bucket
        wait = 0.0 if bucket is None else bucket.take()
        if wait:
            raise RouterError.overloaded(
                f"{key.describe()} is over its rate limit "
                f"(requests_per_s={bucket.rate:g}); retry in {wait:.2g} s",
                reason="key_rate",
                retry_after_s=wait,
            )

    def key_in_flight(self, key: ApiKey) -> int:
        state = self._keys.get(key.name)
        return 0 if state is None else state.in_flight

    @contextmanager
    def admit(self, key: ApiKey | None = None) -> Iterator[None]:
        key = key or self.keyless
        state = None if key is None else self._state(key)
        if state is not None and state.max_streams and state.in_flight >= state.max_streams:
            raise RouterError.overloaded(
                f"{key.describe()} has {state.in_flight} requests in flight, its "
                f"limit (max_streams={state.max_streams}); retry later",
                reason="key_streams",
            )
        if self.in_flight >= self.max_in_flight:
            raise RouterError.overloaded(
                f"the router has {self.in_flight} requests in flight, its limit "
                f"(max_queue={self.max_in_flight}); retry later",
                reason="router_queue",
            )
        self.in_flight += 1
        if state is not None:
            state.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if state is not None:
                state.in_flight -= 1
