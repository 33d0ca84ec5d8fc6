from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tandem.engine.block_manager import BlockPool
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import FinishReason, Sequence, Status
from tests.engine.factories import make_kv

OUT = 7  # the token the fake model always samples
_token_bases = itertools.count(1)


def make_seq(
    request_id: str,
    num_prompt: int = 4,
    max_tokens: int = 4,
    token_ids: list[int] | None = None,
) -> Sequence:
    """A waiting request; its prompt tokens are unique unless ``token_ids`` is given."""
    if token_ids is None:
        base = 1000 * next(_token_bases)
        token_ids = list(range(base, base + num_prompt))
    return Sequence(request_id, list(token_ids), len(token_ids), SamplingParams(max_tokens))


@dataclass
class Harness:
    """A Scheduler driven the way the engine drives it, over a fake model.

    The fake model records what each KV slot holds, so every step also checks
    that a sequence only ever attends to KV of its own prefix (a prefix hit on
    the wrong block, or a reused block that kept a stale hash, fails here) and
    never writes into a block another sequence shares.
    """

    sched: Scheduler
    # (block, offset) -> the tokens whose KV the slot holds: its own and all before it
    slots: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    prefix_hits: int = 0  # admissions that started with cached tokens
    preemptions: int = 0

    @property
    def pool(self) -> BlockPool:
        return self.sched.kv.pool

    def add(self, *seqs: Sequence) -> None:
        for seq in seqs:
            self.sched.add(seq)

    def step(self) -> ScheduledBatch:
        """schedule -> forward -> commit -> sample one token -> finish at max_tokens."""
        waiting = set(map(id, self.sched.waiting))
        batch = self.sched.schedule()
        self.check_batch(batch)
        self.prefix_hits += sum(id(s) in waiting and s.num_computed > 0 for s, _ in batch.work)
        self.preemptions += len(batch.preempted)
        for seq, n in batch.work:
            self._forward(seq, n)
        for seq, n in batch.work:
            seq.num_computed += n
        for seq, _ in batch.work:
            self.sched.kv.commit(seq)
        for seq, _ in batch.work:
            if seq.num_computed == len(seq.token_ids):
                seq.token_ids.append(OUT)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish_reason = FinishReason.LENGTH
                    self.sched.finish(seq)
        self.check_state()
        return batch

    def run_to_completion(self, max_steps: int = 1000) -> int:
        for steps in itertools.count():
            if not self.sched.has_work():
                return steps
            assert steps < max_steps, "scheduler made no progress"
            assert self.step(), "work is queued but nothing was scheduled"
        raise AssertionError("unreachable")

    def make_running(self, seq: Sequence, num_computed: int) -> None:
        """Put ``seq`` straight into the running set with ``num_computed`` tokens of KV.

        For states that plain scheduling does not produce, e.g. an older sequence
        still in prefill while a newer one decodes.
        """
        assert self.sched.kv.ensure(seq, num_computed)
        self._forward(seq, num_computed)
        seq.num_computed = num_computed
        self.sched.add_running(seq)
        self.check_state()

    def _forward(self, seq: Sequence, n: int) -> None:
        # A slot's KV depends on its token and everything before it, so that is what we record.
        bs = self.sched.kv.block_size
        table = seq.block_table
        for p in range(seq.num_computed):
            got = self.slots.get((table[p // bs], p % bs))
            assert got == tuple(seq.token_ids[: p + 1]), f"{seq.request_id} position {p}: {got}"
        for p in range(seq.num_computed, seq.num_computed + n):
            block = table[p // bs]
            assert self.pool.ref_counts[block] == 1, f"write into shared block {block}"
            self.slots[(block, p % bs)] = tuple(seq.token_ids[: p + 1])

    def check_batch(self, batch: ScheduledBatch) -> None:
        sched = self.sched
        sizes = [n for _, n in batch.work]
        assert sum(sizes) <= sched.max_num_batched_tokens
        assert all(n >= 1 for n in sizes)
        assert sizes == sorted(sizes, key=lambda n: n != 1), "single-token work must come first"
        assert len({id(s) for s, _ in batch.work}) == len(batch.work)
        for seq, n in batch.work:
            assert seq.status is Status.RUNNING and seq in sched.running
            assert seq.num_computed + n <= len(seq.token_ids)
            assert len(seq.block_table) >= sched.kv.blocks_for(seq.num_computed + n)
        self.check_state()

    def check_state(self) -> None:
        """Pool integrity, and every reference is held by exactly one live table entry."""
        sched = self.sched
        self.pool.check_integrity()
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks
        assert len(sched.running) <= sched.max_num_seqs
        assert all(s.status is Status.RUNNING for s in sched.running)
        assert all(s.status is Status.WAITING and not s.block_table for s in sched.waiting)
        held = Counter(b for s in sched.running for b in s.block_table)
        assert self.pool.ref_counts == [held[b] for b in range(self.pool.num_blocks)]


def make_harness(
    num_blocks: int = 32,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefix_caching: bool = True,
) -> Harness:
    kv = make_kv(num_blocks, block_size, prefix_caching)
    return Harness(Scheduler(kv, max_num_seqs, max_num_batched_tokens))


def assert_drained(h: Harness) -> None:
    h.check_state()
    assert not h.sched.has_work()
    assert h.pool.num_used == 0
    assert h.pool.num_free == h.pool.num_blocks


# --- budget and chunked prefill ---


def test_token_budget_caps_each_step() -> None:
    h = make_harness(max_num_batched_tokens=16)
    a, b, c = make_seq("a", 10), make_seq("b", 10), make_seq("c", 10)
    h.add(a, b, c)

    assert h.step().work == [(a, 10), (b, 6)]
    assert list(h.sched.waiting) == [c]
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])

    assert h.step().work == [(a, 1), (b, 4), (c, 10)]
    assert (b.block_table, c.block_table) == ([3, 4, 5], [6, 7, 8])

    h.run_to_completion()
    assert [s.output_ids for s in (a, b, c)] == [[OUT] * 4] * 3
    assert_drained(h)


def test_long_prompt_is_prefilled_in_chunks() -> None:
    h = make_harness(max_num_batched_tokens=8)
    s = make_seq("s", num_prompt=20, max_tokens=2)
    h.add(s)

    assert h.step().work == [(s, 8)]
    assert (s.num_computed, len(s), s.block_table) == (8, 20, [0, 1])
    assert s.num_hashed_blocks == 2
    assert h.step().work == [(s, 8)]
    assert (s.num_computed, len(s), s.block_table) == (16, 20, [0, 1, 2, 3])
    assert h.step().work == [(s, 4)]  # the prompt is done: a token is sampled
    assert (s.num_computed, len(s), s.block_table) == (20, 21, [0, 1, 2, 3, 4])
    assert s.num_hashed_blocks == 5
    assert h.step().work == [(s, 1)]
    assert s.status is Status.FINISHED
    assert s.output_ids == [OUT, OUT]
    assert_drained(h)


def test_prefix_hit_schedules_only_the_uncached_tokens() -> None:
    h = make_harness()
    a = make_seq("a", 10)
    h.add(a)
    assert h.step().work == [(a, 10)]
    b = make_seq("b", token_ids=a.token_ids[:10])
    h.add(b)
    assert h.step().work == [(a, 1), (b, 2)]
    assert b.block_table == [0, 1, 3]
    kv = h.sched.kv
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (20, 8)
    h.run_to_completion()
    assert_drained(h)


# --- ordering ---


def test_running_decodes_are_scheduled_before_admitting_waiting_requests() -> None:
    h = make_harness(max_num_batched_tokens=2)
    a, b = make_seq("a", 1, max_tokens=3), make_seq("b", 1, max_tokens=3)
    h.add(a, b)
    assert h.step().work == [(a, 1), (b, 1)]
    c = make_seq("c", 2)
    h.add(c)
    assert h.step().work == [(a, 1), (b, 1)]
    assert h.step().work == [(a, 1), (b, 1)]  # a and b finish here
    assert (c.status, c.block_table, c.num_computed) == (Status.WAITING, [], 0)
    assert h.step().work == [(c, 2)]
    h.run_to_completion()
    assert_drained(h)


def test_decodes_are_scheduled_before_running_prefills() -> None:
    h = make_harness(max_num_batched_tokens=4)
    older_prefill = make_seq("p", 12)
    newer_decode = make_seq("d", 3)
    newer_decode.token_ids.append(OUT)
    h.make_running(older_prefill, 2)
    h.make_running(newer_decode, 3)
    # In admission order the prefill would take the whole budget.
    assert h.step().work == [(newer_decode, 1), (older_prefill, 3)]
    h.run_to_completion()
    assert_drained(h)


def test_decodes_past_the_token_budget_take_turns() -> None:
    # A decode worker runs arrived KV up to max_num_seqs, whatever the budget: the same
    # first two decodes every step left the others without a token until those ended.
    h = make_harness(max_num_batched_tokens=2)
    seqs = [make_seq(name, 3, max_tokens=9) for name in "abcd"]
    for seq in seqs:
        seq.token_ids.append(OUT)
        h.make_running(seq, 3)
    served = ["".join(s.request_id for s, _ in h.step().work) for _ in range(4)]
    assert served == ["ab", "cd", "ab", "cd"]
    h.run_to_completion()
    assert_drained(h)


def test_a_running_prefill_takes_its_turn_when_decodes_fill_the_budget() -> None:
    # A prompt prefilled where it decodes (prefill_here) got no budget until the
    # decodes ahead of it had ended: its first token came 80 steps late.
    h = make_harness(max_num_batched_tokens=2)
    for name in "abcd":
        seq = make_seq(name, 3, max_tokens=30)
        seq.token_ids.append(OUT)
        h.make_running(seq, 3)
    here = make_seq("here", 6)
    h.make_running(here, 0)
    turns = [[s.request_id for s, _ in h.step().work] for _ in range(3)]
    assert any("here" in t for t in turns), turns
    assert all(len(t) <= 2 for t in turns)
    h.run_to_completion()
    assert_drained(h)


def test_a_preempted_sequence_is_dropped_from_the_batch_it_was_scheduled_in() -> None:
    h = make_harness(num_blocks=3, max_num_batched_tokens=8)
    older_prefill = make_seq("p", 10, max_tokens=2)  # 12 tokens: fits the pool alone
    newer_decode = make_seq("d", 7)
    newer_decode.token_ids.append(OUT)
    h.make_running(older_prefill, 4)  # [0]
    h.make_running(newer_decode, 7)  # [1, 2]
    # d is scheduled first; p's block is full and none is free, so not one of its
    # tokens fits: the newest sequence, d, is preempted and leaves the batch.
    batch = h.step()
    assert batch.preempted == [newer_decode]
    assert batch.work == [(older_prefill, 6)]
    assert older_prefill.block_table == [0, 2, 1]
    assert (newer_decode.status, newer_decode.block_table) == (Status.WAITING, [])
    h.run_to_completion()
    assert_drained(h)


def test_a_prefill_chunk_shrinks_to_the_free_blocks_instead_of_preempting() -> None:
    h = make_harness(num_blocks=3, max_num_batched_tokens=8)
    older_prefill = make_seq("p", 10, max_tokens=2)
    newer_decode = make_seq("d", 3)
    newer_decode.token_ids.append(OUT)
    h.make_running(older_prefill, 4)  # [0]
    h.make_running(newer_decode, 3)  # [1]
    batch = h.step()  # p wants 6 tokens; one free block holds 4 of them
    assert batch.preempted == []
    assert batch.work == [(newer_decode, 1), (older_prefill, 4)]
    assert older_prefill.block_table == [0, 2]
    h.run_to_completion()
    assert_drained(h)


def test_single_token_work_comes_first() -> None:
    h = make_harness(max_num_batched_tokens=8)
    a, b = make_seq("a", 4), make_seq("b", 1)
    h.add(a, b)
    assert h.step().work == [(b, 1), (a, 4)]
    assert h.sched.running == [a, b]  # admission order is unchanged


def test_max_num_seqs_caps_running() -> None:
    h = make_harness(max_num_seqs=2)
    a, b, c = (make_seq(r, 2, max_tokens=2) for r in "abc")
    h.add(a, b, c)
    assert h.step().work == [(a, 2), (b, 2)]
    assert h.sched.running == [a, b]
    assert list(h.sched.waiting) == [c]
    assert h.step().work == [(a, 1), (b, 1)]  # both finish; c was not admitted this step
    assert h.step().work == [(c, 2)]
    h.run_to_completion()
    assert_drained(h)


# --- preemption ---


def test_out_of_blocks_preempts_the_most_recently_admitted() -> None:
    h = make_harness(num_blocks=6)
    a, b = make_seq("a", 8, max_tokens=3), make_seq("b", 8, max_tokens=3)
    c, d = make_seq("c", 7, max_tokens=3), make_seq("d", 4, max_tokens=2)
    h.add(a, b, c, d)

    first = h.step()
    assert first.work == [(a, 8), (b, 8), (c, 7)]  # d does not fit
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    assert list(h.sched.waiting) == [d]

    # a and b each need a third block: c, the newest, gives its two back.
    second = h.step()
    assert second.preempted == [c]
    assert second.work == [(a, 1), (b, 1)]
    assert (a.block_table, b.block_table) == ([0, 1, 5], [2, 3, 4])
    assert (c.status, c.block_table, c.num_computed) == (Status.WAITING, [], 0)
    assert c.token_ids[7] == OUT  # its sampled token is kept and recomputed later
    assert list(h.sched.waiting) == [c, d]

    # Still no room for c (its cached first block went to b), nor for d behind it.
    third = h.step()
    assert third.work == [(a, 1), (b, 1)]
    assert third.preempted == []
    assert list(h.sched.waiting) == [c, d]
    assert (a.status, b.status) == (Status.FINISHED, Status.FINISHED)

    # a freed [5, 1, 0] and b [4, 3, 2]: c recomputes all 8 tokens, ahead of d.
    fourth = h.step()
    assert fourth.work == [(c, 8), (d, 4)]
    assert (c.block_table, d.block_table) == ([5, 1], [0])
    h.run_to_completion()
    assert c.output_ids == [OUT] * 3
    assert d.output_ids == [OUT, OUT]
    assert_drained(h)


def test_a_preempted_sequence_keeps_its_place_by_arrival_when_it_comes_back() -> None:
    # Back in, it was appended as the most recently admitted, after requests that
    # arrived after it (a decode worker's reservations whose KV came meanwhile), and
    # so was the next victim, again and again, while they ran on.
    h = make_harness(num_blocks=9, prefix_caching=False)
    s = h.sched
    a, b, c = (make_seq(name, 4, 20) for name in "abc")
    h.add(a, b, c)
    h.step()
    d = make_seq("d", 4, 20)  # arrives after c: reserved, its KV on its way
    assert s.kv.ensure(d, 5)
    s.reserve(d)
    s._preempt(c)  # a shortage took c, the newest then
    h._forward(d, 4)
    d.num_computed = 4
    d.token_ids.append(7)
    s.add_running(d)  # d's KV arrived
    h.step()  # c comes back
    assert s.running == [a, b, c, d]
    while not (batch := h.step()).preempted:
        pass
    assert batch.preempted == [d]


def test_a_victims_tokens_in_the_step_go_back_to_its_budget() -> None:
    # A decode that preempts a sequence scheduled earlier in the same step (streams
    # take turns) drops it from the batch, but its tokens stayed spent: the step ran
    # one token of eight while other streams that fit got none.
    h = make_harness(num_blocks=10, max_num_seqs=16, max_num_batched_tokens=8)
    decodes = []
    for i in range(8):  # 8 decodes for a budget of 8: they take turns
        d = make_seq(f"d{i}", 4)
        d.token_ids.append(7)  # a full block computed; its new token needs a second
        h.make_running(d, 4)
        decodes.append(d)
    p = make_seq("p", 8)  # the newest: a prefill, its blocks held, its turn due first
    h.make_running(p, 1)
    assert h.sched.kv.ensure(p, 8) and h.pool.num_free == 0
    for seq in h.sched.running:
        seq.turn = 0 if seq is p else 1
    batch = h.sched.schedule()
    # p's blocks go to d0 and d1; d2..d4 take the newest decodes' blocks, as any decode
    # that needs one does: 5 tokens of the budget's 8 (5 + 3 victims).
    assert batch.preempted == [p, *decodes[:4:-1]]
    assert batch.work == [(d, 1) for d in decodes[:5]]


def test_newest_sequence_preempts_itself_and_resumes_from_its_cached_prefix() -> None:
    h = make_harness(num_blocks=5)
    a, b = make_seq("a", 8, max_tokens=3), make_seq("b", 8, max_tokens=3)
    h.add(a, b)
    assert h.step().work == [(a, 8), (b, 8)]

    second = h.step()  # a takes the last free block; b has no one newer to preempt
    assert second.preempted == [b]
    assert second.work == [(a, 1)]
    assert a.block_table == [0, 1, 4]
    assert (b.status, b.block_table, b.num_computed) == (Status.WAITING, [], 0)

    third = h.step()  # b's prefix is cached, but its next token needs a block: a finishes
    assert third.work == [(a, 1)]
    assert (a.status, b.status) == (Status.FINISHED, Status.WAITING)

    fourth = h.step()  # b's hashed blocks 2 and 3 were still cached: one token to compute
    assert fourth.work == [(b, 1)]
    assert b.block_table == [2, 3, 4]
    h.run_to_completion()
    assert b.output_ids == [OUT] * 3
    # Each prompt looked up once, when first admitted: b's own blocks found again after
    # its preemption are not prefix-cache hits (the hit rate would rise with pressure).
    assert (h.sched.kv.prefix_query_tokens, h.sched.kv.prefix_hit_tokens) == (16, 0)
    assert_drained(h)


# --- finish ---


def test_finish_frees_a_running_sequence_mid_prefill() -> None:
    h = make_harness(max_num_batched_tokens=4)
    a = make_seq("a", 10)
    h.add(a)
    assert h.step().work == [(a, 4)]
    assert h.pool.num_used == 1
    h.sched.finish(a)
    assert a.status is Status.FINISHED
    assert a.block_table == []
    assert h.sched.running == []
    assert_drained(h)


def test_finish_removes_a_waiting_sequence() -> None:
    h = make_harness(max_num_seqs=1)
    a, b = make_seq("a", 4), make_seq("b", 4)
    h.add(a, b)
    h.step()
    h.sched.finish(b)
    assert b.status is Status.FINISHED
    assert list(h.sched.waiting) == []
    assert h.sched.running == [a]
    h.check_state()
    h.run_to_completion()
    assert_drained(h)


def test_finish_of_a_preempted_sequence() -> None:
    h = make_harness(num_blocks=5)
    a, b = make_seq("a", 8, max_tokens=4), make_seq("b", 8, max_tokens=4)
    h.add(a, b)
    h.step()
    assert h.step().preempted == [b]
    h.sched.finish(b)
    assert list(h.sched.waiting) == []
    assert (b.status, b.block_table) == (Status.FINISHED, [])
    h.check_state()
    h.run_to_completion()
    assert a.output_ids == [OUT] * 4
    assert_drained(h)


# --- random workloads ---


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: int  # step at which it is added
    abort_at: int | None  # step at which the client cancels it, if any


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[Request]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 10))
    config = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_num_seqs": draw(st.integers(1, 4)),
        "max_num_batched_tokens": draw(st.integers(1, 16)),
        "prefix_caching": draw(st.booleans()),
    }
    capacity = num_blocks * block_size  # the engine rejects anything longer
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, capacity - 1))
        # A prefix common to all requests (often the whole prompt), then a tail from a
        # small alphabet, so equal blocks after different prefixes are common too.
        shared = draw(st.just(prompt_len) | st.integers(0, prompt_len))
        tail = st.lists(
            st.integers(100, 102), min_size=prompt_len - shared, max_size=prompt_len - shared
        )
        prompt = list(range(shared)) + draw(tail)
        requests.append(
            Request(
                prompt=prompt,
                max_tokens=draw(st.integers(1, capacity - prompt_len)),
                arrival=draw(st.integers(0, 6)),
                abort_at=draw(st.integers(0, 30)) if draw(st.integers(0, 3)) == 0 else None,
            )
        )
    return config, requests


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads_run_to_completion_without_leaks(
    workload: tuple[dict, list[Request]],
) -> None:
    config, requests = workload
    h = make_harness(**config)
    seqs = [
        make_seq(f"r{i}", token_ids=r.prompt, max_tokens=r.max_tokens)
        for i, r in enumerate(requests)
    ]
    for step in itertools.count():
        assert step < 2000, "scheduler made no progress"
        for r, seq in zip(requests, seqs, strict=True):
            if r.arrival == step:
                h.add(seq)
            if r.abort_at == step and r.arrival <= step and not seq.finished:
                seq.finish_reason = FinishReason.CANCELLED
                h.sched.finish(seq)
                h.check_state()
        if all(seq.finished for seq in seqs):
            break
        had_work = h.sched.has_work()
        batch = h.step()
        assert bool(batch) == had_work

    event(f"preempted: {h.preemptions > 0}")
    event(f"prefix hit: {h.prefix_hits > 0}")
    event(f"cancelled: {any(s.finish_reason is FinishReason.CANCELLED for s in seqs)}")
    for r, seq in zip(requests, seqs, strict=True):
        assert seq.status is Status.FINISHED
        assert seq.block_table == []
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.output_ids == [OUT] * r.max_tokens
        else:
            assert seq.finish_reason is FinishReason.CANCELLED
            assert seq.num_output_tokens < r.max_tokens
    assert_drained(h)
