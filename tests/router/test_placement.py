"""Placement policies: exact choices on synthetic loads."""

from __future__ import annotations

import pytest

from tandem.engine.block_manager import prefix_root
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.errors import ConfigError
from tandem.router.placement import (
    LeastLoaded,
    Pool,
    PrefixAware,
    RoundRobin,
    WorkerLoad,
    make_policy,
)
from tandem.router.registry import Worker
from tests.engine.factories import make_kv


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
    w.active_at_poll = 2
    w.inflight, w.reserved_since_poll = 4, 30
    assert w.load() == WorkerLoad("w", queue_depth=4, running=3, kv_blocks_free=70, inflight=4)
    w.reserved_since_poll = 130
    assert w.load().kv_blocks_free == 0


def test_worker_load_leaves_out_what_ended_since_the_poll():
    # Polled while it ran this router's one request: once that is done, the worker is
    # idle, not busy until its next poll (short requests in a row all went elsewhere).
    w = worker(running=1)
    w.inflight = w.active_at_poll = 1
    assert (w.load().queue_depth, w.load().running) == (0, 1)
    w.inflight = 0
    assert (w.load().queue_depth, w.load().running) == (0, 0)
    # Others' requests stay counted; ours beyond what was running came off the queue.
    w = worker(queue_depth=3, running=2)
    w.active_at_poll, w.inflight = 3, 0
    assert (w.load().queue_depth, w.load().running) == (2, 0)


def test_a_burst_between_polls_spreads_over_equal_workers():
    policy = LeastLoaded()
    ws = [worker(kv_blocks_free=100), worker(kv_blocks_free=100)]
    ws[0].address, ws[1].address = "a", "b"
    picks = []
    for _ in range(4):
        chosen = policy.pick(Pool.DECODE, [w.load() for w in ws]).address
        picks.append(chosen)
        target = ws[0] if chosen == "a" else ws[1]
        target.inflight += 1  # as WorkerRegistry.acquire does
    assert picks == ["a", "b", "a", "b"]


def _prompt(prefix: int, blocks: int, tail: int = 0) -> list[int]:
    """``blocks`` 16-token blocks of a shared prefix ``prefix``, then a distinct tail."""
    return [1000 + prefix] * (16 * blocks) + [7] * tail


def _engine_hashes(prompt: list[int], salt: str, block_size: int, blocks: int) -> list[int]:
    """The hashes an engine's prefix cache gives the first ``blocks`` blocks of ``prompt``."""
    seq = Sequence("r", list(prompt), len(prompt), SamplingParams())
    seq.cache_root = seq.last_block_hash = prefix_root(salt)
    kv = make_kv(num_blocks=16, block_size=block_size)
    assert kv.ensure(seq, len(prompt))
    seq.num_computed = len(prompt)
    kv.commit(seq)
    return [kv.pool.block_hash[b] for b in seq.block_table[:blocks]]


def place(policy, pool: Pool, candidates, token_ids=(), cache_salt: str = "") -> WorkerLoad:
    """A pick that the worker takes: what the relay does when it accepts the request."""
    choice = policy.pick(pool, candidates, token_ids, cache_salt)
    policy.holds(pool, choice.address, token_ids, cache_salt)
    return choice


def test_prefix_aware_follows_the_prefix_and_spreads_what_is_new():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    first = place(policy, Pool.PREFILL, ws, _prompt(1, 8, tail=3)).address
    second = place(policy, Pool.PREFILL, ws, _prompt(2, 8, tail=3)).address
    assert first != second  # nothing cached anywhere: least-loaded takes turns
    for tail in range(1, 6):  # same system prompt, another question: where it was
        assert place(policy, Pool.PREFILL, ws, _prompt(1, 8, tail=tail)).address == first
        assert place(policy, Pool.PREFILL, ws, _prompt(2, 8, tail=tail)).address == second
    # The pools keep separate histories: the decode pool has seen nothing yet.
    assert policy._history[Pool.DECODE] == {}


def test_prefix_aware_matches_within_a_cache_salt_as_the_workers_do():
    # The workers' prefix caches are per salt (an API key's): a prompt placed under
    # one salt is no cached prefix for another, and the chain is the workers' own.
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    prompt = _prompt(1, 8, tail=3)
    home = place(policy, Pool.PREFILL, ws, prompt, "alice").address
    place(policy, Pool.PREFILL, ws, prompt, "bob")
    assert policy.cached_tokens == 0
    assert place(policy, Pool.PREFILL, ws, prompt, "alice").address == home
    assert policy.cached_tokens == 8 * 16
    assert _engine_hashes(prompt, "alice", 16, 8) == policy._hashes(prompt, "alice")


def test_prefix_aware_counts_in_each_workers_own_block_size():
    # Workers of engine.block_size 32 cache whole blocks of 32: the router's history,
    # its estimate of tokens held and its bound on what a worker holds are in them too
    # (they were in blocks of 16 whatever the workers used).
    policy = PrefixAware()
    big = [load("a", kv_blocks_total=4, kv_block_size=32)]
    prompt = _prompt(1, 5, tail=3)  # 80 tokens of prefix: two whole blocks of 32
    place(policy, Pool.PREFILL, big, prompt, "alice")
    place(policy, Pool.PREFILL, big, prompt, "alice")
    assert policy.cached_tokens == 64
    cached = _engine_hashes(prompt, "alice", 32, 2)
    assert list(policy._history[Pool.PREFILL]["a"]) == cached[::-1]
    # 4 blocks of 32 hold this prompt and one other of the same length: a third pushes
    # the first out (in blocks of 16 the history would have held 4 of its blocks).
    place(policy, Pool.PREFILL, big, _prompt(2, 5, tail=3))
    assert place(policy, Pool.PREFILL, big, prompt, "alice") and policy.cached_tokens == 64
    place(policy, Pool.PREFILL, big, _prompt(3, 5, tail=3))
    place(policy, Pool.PREFILL, big, _prompt(4, 5, tail=3))
    place(policy, Pool.PREFILL, big, prompt, "alice")
    assert policy.cached_tokens == 0


def test_prefix_aware_counts_no_more_than_a_windowed_worker_caches():
    # A decode worker with a KV window keeps a prompt's blocks only up to its first
    # slide: counted whole, a 10-block prompt looked cached and "short" to prefill
    # there, and the worker computed 6 blocks of it while its streams waited.
    policy = PrefixAware()
    windowed = [load("a", kv_blocks_free=1000, kv_blocks_total=1000, prefix_cache_max_tokens=64)]
    prompt = _prompt(1, 10, tail=3)
    place(policy, Pool.DECODE, windowed, prompt)
    assert len(policy._history[Pool.DECODE]["a"]) == 4
    place(policy, Pool.DECODE, windowed, prompt)
    assert policy.cached_tokens == 64
    policy.holds(Pool.DECODE, "a", [*prompt, *range(200)])
    assert len(policy._history[Pool.DECODE]["a"]) == 4
    # Its room is still counted for the whole prompt, which arrives whole: 7 blocks more.
    short = load("a", kv_blocks_free=6, kv_blocks_total=1000, prefix_cache_max_tokens=64)
    roomy = load("b", kv_blocks_free=1000, kv_blocks_total=1000)
    assert place(policy, Pool.DECODE, [short, roomy], prompt).address == "b"


def test_prefix_aware_passes_over_a_holder_without_room_for_the_reservation():
    # It would refuse the reservation however much of the prompt it holds; with every
    # holder full, the request waited out queue_timeout_s while a worker had room.
    policy = PrefixAware()
    roomy = {"kv_blocks_free": 1000, "kv_blocks_total": 1000}
    prompt = _prompt(1, 8, tail=3)
    home = place(policy, Pool.DECODE, [load("a", **roomy), load("b", **roomy)], prompt).address
    other = "b" if home == "a" else "a"
    # With room for this request many times over, fewer free blocks than another's and
    # 2 requests more (within the bound) keep it where its prefix is.
    busier = [load(home, kv_blocks_free=850, running=2, kv_blocks_total=1000), load(other, **roomy)]
    assert place(policy, Pool.DECODE, busier, prompt).address == home
    full = [load(home, kv_blocks_free=0, kv_blocks_total=1000), load(other, **roomy)]
    assert place(policy, Pool.DECODE, full, prompt).address == other
    assert place(policy, Pool.DECODE, [load(home, **roomy)], prompt).address == home
    assert policy.cached_tokens == 8 * 16  # still held there
    policy.forget(Pool.DECODE, home)
    place(policy, Pool.DECODE, [load(home, **roomy)], prompt)
    assert policy.cached_tokens == 0


def test_prefix_aware_takes_the_longest_match():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    place(policy, Pool.PREFILL, ws, _prompt(1, 2, tail=1))  # a: 2 blocks of prefix 1
    longer = _prompt(1, 6, tail=1)
    place(policy, Pool.PREFILL, [ws[1]], longer)  # b: 6 blocks of it
    assert place(policy, Pool.PREFILL, ws, longer).address == "b"


def test_prefix_aware_gives_way_to_load_beyond_the_bound():
    policy = PrefixAware(imbalance_max=2)
    idle = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    home = place(policy, Pool.PREFILL, idle, _prompt(1, 4, tail=1)).address
    other = "b" if home == "a" else "a"
    within = [load(home, queue_depth=1, running=1, kv_blocks_total=100),
              load(other, kv_blocks_total=100)]  # fmt: skip
    assert place(policy, Pool.PREFILL, within, _prompt(1, 4, tail=2)).address == home
    beyond = [load(home, queue_depth=2, running=1, kv_blocks_total=100),
              load(other, kv_blocks_total=100)]  # fmt: skip
    assert place(policy, Pool.PREFILL, beyond, _prompt(1, 4, tail=3)).address == other


def test_prefix_aware_forgets_what_the_worker_cannot_hold():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=4)]
    place(policy, Pool.PREFILL, ws, _prompt(1, 4, tail=1))
    place(policy, Pool.PREFILL, ws, _prompt(2, 4, tail=1))  # 4 new blocks push the first out
    assert policy._matched(policy._history[Pool.PREFILL]["a"], policy._hashes(
        _prompt(1, 4, tail=1))) == 0  # fmt: skip


def test_prefix_aware_forgets_a_sequence_tail_first_as_the_worker_evicts():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=10)]
    first, second = _prompt(1, 6, tail=1), _prompt(2, 6, tail=1)
    place(policy, Pool.PREFILL, ws, first)
    place(policy, Pool.PREFILL, ws, second)  # 12 blocks in 10: two of the first go
    # The worker frees a sequence's last blocks first and keeps its beginning.
    held = policy._history[Pool.PREFILL]["a"]
    assert policy._matched(held, policy._hashes(first)) == 4
    assert policy._matched(held, policy._hashes(second)) == 6


def test_prefix_aware_hashes_as_the_engine_does():
    from tandem.engine.block_manager import hash_block

    tokens = list(range(40))
    hashes = PrefixAware()._hashes(tokens)
    first = hash_block(None, tokens[:16])
    assert hashes == [first, hash_block(first, tokens[16:32])]
    assert PrefixAware()._hashes(tokens[:16]) == []  # the last token is always computed


def test_prefix_aware_does_not_follow_a_short_shared_header():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    header = [5] * 16  # one block every prompt starts with (a chat template's, say)
    first = place(policy, Pool.PREFILL, ws, header + _prompt(1, 6, tail=1)).address
    # 1 block of 7 in common: below min_match, so least-loaded's turn, not the header's.
    assert place(policy, Pool.PREFILL, ws, header + _prompt(2, 6, tail=1)).address != first


def test_prefix_aware_follows_a_conversation_to_the_worker_that_generated_its_reply():
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    turn1 = _prompt(1, 4, tail=5)
    place(policy, Pool.DECODE, ws[:1], turn1)  # both hold the prompt's 4 blocks
    place(policy, Pool.DECODE, ws[1:], turn1)
    reply = list(range(2000, 2043))  # 69 + 43 tokens: 7 full blocks, the last not computed
    policy.holds(Pool.DECODE, "b", turn1 + reply)  # b generated the reply
    # The next turn repeats the first and its reply: its full blocks up to the
    # reply's last token are b's.
    turn2 = turn1 + reply + [9] * 40
    assert place(policy, Pool.DECODE, ws, turn2).address == "b"
    assert policy.cached_tokens == 16 * 6
    policy.holds(Pool.DECODE, "gone", turn2)  # a worker never placed on: ignored
    assert "gone" not in policy._history[Pool.DECODE]


def test_a_burst_with_one_prefix_follows_the_first_pick_and_a_refusal_takes_it_back():
    # Noted only once the worker took the request (a prefill's first token), a burst of
    # prompts with one system prompt spread over every prefill worker, each computing
    # it; noted at the pick and never taken back, a worker that refused was taken to
    # hold the prompt.
    policy = PrefixAware()
    ws = [load("a", kv_blocks_total=100), load("b", kv_blocks_total=100)]
    prompt = _prompt(1, 8, tail=3)
    first = policy.pick(Pool.PREFILL, ws, prompt).address
    noted = policy.noted
    busier = [load(w.address, kv_blocks_total=100, queue_depth=int(w.address == first))
              for w in ws]  # fmt: skip
    assert policy.pick(Pool.PREFILL, busier, prompt).address == first
    assert policy.cached_tokens == 8 * 16
    policy.refused(policy.noted)  # the second pick noted nothing new: nothing goes
    assert policy.pick(Pool.PREFILL, busier, prompt).address == first
    policy.refused(noted)  # the first worker turned the prompt away at its door
    policy.pick(Pool.PREFILL, ws, _prompt(2, 8, tail=3))  # a pick between: nothing held
    assert policy.pick(Pool.PREFILL, busier, prompt).address != first
    assert policy.cached_tokens == 0
