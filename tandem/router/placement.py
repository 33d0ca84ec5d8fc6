"""Placement: which worker of a pool gets the next request.

A policy sees one ``WorkerLoad`` per placeable worker (healthy, in registration
order) and returns one of them. The loads are the last polled ``Status`` numbers
corrected by what the router itself has sent since that poll (see
``registry.Worker.load``), so that a burst of requests between two polls spreads
out instead of piling onto the worker that looked emptiest.

- ``least-loaded``: decode: the workers whose free KV blocks are within a tenth
  of the most any has, then the shortest queue, then the fewest running (a
  difference of a few blocks, such as a prefix cache holds, must not send every
  request to one worker); prefill: the shortest queue, then the fewest running.
  Remaining ties go to the fewest requests in flight from this router, then take
  turns: idle workers share a trickle of requests instead of the first registered
  one taking them all.
- ``round-robin``: each pool in turn, ignoring the numbers.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.errors import ConfigError


class Pool(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    queue_depth: int = 0  # waiting to be scheduled on the worker
    running: int = 0  # in the worker's batch
    kv_blocks_free: int = 0
    inflight: int = 0  # this router's requests on the worker now


# Decode workers with at least this fraction of the most free KV blocks count as equal.
KV_BAND = 0.9


class PlacementPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def pick(self, pool: Pool, candidates: Sequence[WorkerLoad]) -> WorkerLoad:
        """One of ``candidates`` (never empty, in registration order)."""


class LeastLoaded(PlacementPolicy):
    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = {pool: 0 for pool in Pool}

    def pick(self, pool: Pool, candidates: Sequence[WorkerLoad]) -> WorkerLoad:
        if pool is Pool.DECODE:
            most = max(w.kv_blocks_free for w in candidates)
            keys = [
                (w.kv_blocks_free < KV_BAND * most, w.queue_depth, w.running, w.inflight)
                for w in candidates
            ]
        else:
            keys = [(w.queue_depth, w.running, w.inflight) for w in candidates]
        best = min(keys)
        tied = [w for w, k in zip(candidates, keys, strict=True) if k == best]
        turn = self._turn[pool]
        self._turn[pool] = turn + 1
        return tied[turn % len(tied)]


class RoundRobin(PlacementPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = {pool: 0 for pool in Pool}

    def pick(self, pool: Pool, candidates: Sequence[WorkerLoad]) -> WorkerLoad:
        # A counter modulo the current size: membership changes shift the turn,
        # but every placeable worker still gets one request in each len() in a row.
        i = self._next[pool] % len(candidates)
        self._next[pool] = i + 1
        return candidates[i]


_POLICIES: dict[str, type[PlacementPolicy]] = {p.name: p for p in (LeastLoaded, RoundRobin)}


def make_policy(name: str) -> PlacementPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"placement must be one of {', '.join(_POLICIES)}, got {name!r}"
        ) from None
