"""Admission: at most ``max_queue`` requests in flight through the router.

A request is admitted after validation and holds its slot until its stream ends
for any reason. Beyond the bound the answer is RESOURCE_EXHAUSTED at once:
overload is never queued without bound (see LESSONS.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tandem.router.errors import RouterError


class Admission:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    @contextmanager
    def admit(self) -> Iterator[None]:
        if self.in_flight >= self.max_in_flight:
            raise RouterError.overloaded(
                f"the router has {self.in_flight} requests in flight, its limit "
                f"(max_queue={self.max_in_flight}); retry later"
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
