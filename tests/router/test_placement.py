"""Placement policies: exact choices on synthetic loads."""

from __future__ import annotations

import pytest

from tandem.errors import ConfigError
from tandem.router.placement import LeastLoaded, Pool, RoundRobin, WorkerLoad, make_policy
from tandem.router.registry import Worker


def load(address: str, **numbers) -> WorkerLoad:
    return WorkerLoad(address=address, **numbers)


def test_least_loaded_decode_takes_most_free_blocks():
    ws = [
        load("a", kv_blocks_free=100),
        load("b", kv_blocks_free=500),
        load("c", kv_blocks_free=300),
    ]
    assert LeastLoaded().pick(Pool.DECODE, ws).address == "b"


def test_least_loaded_decode_ties_by_queue_then_inflight_then_turns():
    policy = LeastLoaded()
    ws = [
        load("a", kv_blocks_free=100, queue_depth=3),
        load("b", kv_blocks_free=100, queue_depth=1),
    ]
    assert policy.pick(Pool.DECODE, ws).address == "b"
    ws = [load("a", kv_blocks_free=100, inflight=2), load("b", kv_blocks_free=100, inflight=1)]
    assert policy.pick(Pool.DECODE, ws).address == "b"
    ws = [load("a", kv_blocks_free=100), load("b", kv_blocks_free=100), load("c")]
    picks = {policy.pick(Pool.DECODE, ws).address for _ in range(4)}
    assert picks == {"a", "b"}  # equals take turns; c, with no free blocks, never


def test_least_loaded_decode_weighs_running_only_among_similar_free_blocks():
    # 89 is not within a tenth of 100: free KV decides, however busy b is.
    ws = [load("a", kv_blocks_free=89, running=0), load("b", kv_blocks_free=100, running=9)]
    assert LeastLoaded().pick(Pool.DECODE, ws).address == "b"
    # 95 is: a few blocks (a prefix cache's) must not pull every request to b.
    ws = [load("a", kv_blocks_free=95, running=0), load("b", kv_blocks_free=100, running=9)]
    assert LeastLoaded().pick(Pool.DECODE, ws).address == "a"


def test_least_loaded_prefill_takes_shortest_queue_ties_by_running():
    policy = LeastLoaded()
    ws = [load("a", queue_depth=2), load("b", queue_depth=0, running=5), load("c", queue_depth=1)]
    assert policy.pick(Pool.PREFILL, ws).address == "b"
    ws = [load("a", queue_depth=1, running=4), load("b", queue_depth=1, running=2)]
    assert policy.pick(Pool.PREFILL, ws).address == "b"
    # Free KV blocks do not matter for prefill.
    ws = [load("a", kv_blocks_free=0), load("b", kv_blocks_free=999)]
    assert {policy.pick(Pool.PREFILL, ws).address for _ in range(2)} == {"a", "b"}


def test_round_robin_cycles_each_pool_separately():
    policy = RoundRobin()
    ws = [load("a"), load("b"), load("c")]
    assert [policy.pick(Pool.DECODE, ws).address for _ in range(4)] == ["a", "b", "c", "a"]
    assert [policy.pick(Pool.PREFILL, ws[:2]).address for _ in range(3)] == ["a", "b", "a"]
    # A pool that shrank keeps cycling over what is left.
    assert [policy.pick(Pool.DECODE, ws[1:]).address for _ in range(2)] == ["c", "b"]


def test_make_policy_names_and_refuses_unknown():
    assert isinstance(make_policy("least-loaded"), LeastLoaded)
    assert isinstance(make_policy("round-robin"), RoundRobin)
    with pytest.raises(ConfigError, match="placement must be one of least-loaded, round-robin"):
        make_policy("random")


def worker(**numbers) -> Worker:
    return Worker("w", Pool.DECODE, channel=None, stub=None, last_ok=0.0, **numbers)


def test_worker_load_counts_what_the_router_sent_since_the_poll():
    w = worker(queue_depth=2, running=3, kv_blocks_free=100)
    w.inflight, w.placed_since_poll, w.reserved_since_poll = 4, 2, 30
    assert w.load() == WorkerLoad("w", queue_depth=4, running=3, kv_blocks_free=70, inflight=4)
    w.reserved_since_poll = 130
    assert w.load().kv_blocks_free == 0


def test_a_burst_between_polls_spreads_over_equal_workers():
    policy = LeastLoaded()
    ws = [worker(kv_blocks_free=100), worker(kv_blocks_free=100)]
    ws[0].address, ws[1].address = "a", "b"
    picks = []
    for _ in range(4):
        chosen = policy.pick(Pool.DECODE, [w.load() for w in ws]).address
        picks.append(chosen)
        target = ws[0] if chosen == "a" else ws[1]
        target.placed_since_poll += 1  # as WorkerRegistry.acquire does
        target.inflight += 1
    assert picks == ["a", "b", "a", "b"]
