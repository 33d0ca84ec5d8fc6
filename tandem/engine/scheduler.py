"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget. Running decodes come first (one token each, so
inter-token latency does not suffer from admissions), then running sequences
that are part-way through a chunked prefill, then waiting requests in arrival
order. Where the running decodes alone fill the budget (a decode worker takes in
arrived KV up to ``max_num_seqs``, whatever the budget), every running sequence
takes turns, least recently run first (a running prefill too), and a preempted
sequence waiting to run again is kept a token of each step. A sequence that cannot get a KV
block preempts the running sequence that arrived last, which is swapped out to
the host tier where there is one with room, else has its blocks freed and its
tokens recomputed later; back, it takes its place by arrival again (appended as
the most recently admitted, it was the next victim, again and again, while requests
that arrived after it ran on).

On a decode worker a request may also hold a slot before it runs: reserved, its
blocks waiting for the KV a prefill worker sends (``reserve``). Reserved sequences
count against ``max_num_seqs`` as running ones do, so that a preempted sequence
coming back cannot take a slot already promised (the engine, for its part, makes
no new reservation while a preempted sequence waits).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from tandem.engine.kv_cache import KVCache
from tandem.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """``work`` pairs each sequence with its number of new tokens; decodes (1 token) first."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.work)


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of arrival (Sequence.arrival)
        self.reserved: dict[str, Sequence] = {}  # by request id: a slot each, KV to come
        self._step = 0  # steps scheduled so far (Sequence.turn)
        self._arrivals = itertools.count()  # Sequence.arrival

    def _arrived(self, seq: Sequence) -> None:
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)

    def _run(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def add(self, seq: Sequence) -> None:
        self._arrived(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._step += 1
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        order = decodes + [s for s in self.running if s.num_uncomputed > 1]
        held = 0  # kept for a preempted sequence's return
        if len(decodes) >= budget:
            # Not every running sequence gets a token: the same first ones every step
            # would starve the rest (and a prefill, and a preempted sequence, until
            # they ended). Least recently run first; decodes first among equals.
            order.sort(key=lambda s: s.turn)
            # (Not out of a budget of 1: the running ones would get nothing, and if the
            # waiting one found no blocks, nothing would run to free any.)
            held = int(budget > 1 and bool(self.waiting) and self.waiting[0].admitted)
        budget -= held
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self.kv.window_chunk(seq, min(seq.num_uncomputed, budget))
            n, freed = self._reserve(seq, n, batch)
            budget += freed  # what its victims were given earlier in this step
            if n:
                batch.work.append((seq, n))
                budget -= n
                seq.turn = self._step
        budget += held

        while self.waiting and budget > 0 and self.slots_taken() < self.max_num_seqs:
            seq = self.waiting[0]
            swapped = seq.host_blocks is not None
            if swapped:  # preempted by swapping: back in, its computed KV with it
                n = self.kv.window_chunk(seq, min(seq.num_uncomputed, budget))
                if not self.kv.swap_in(seq, seq.num_computed + n):
                    break
            else:
                self.kv.match_prefix(seq)
                self.kv.slide(seq)  # a cached prefix longer than a KV window
                n = self.kv.window_chunk(seq, min(seq.num_uncomputed, budget))
                if not self.kv.ensure(seq, seq.num_computed + n):
                    self.kv.free(seq)  # do not hold prefix blocks while waiting
                    break
            self.waiting.popleft()
            self.kv.count_admission(seq)
            seq.turn = self._step
            self._run(seq)
            batch.work.append((seq, n))
            budget -= n
        # The model runner wants single-token work first (the batched decode path).
        batch.work.sort(key=lambda w: w[1] != 1)
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> tuple[int, int]:
        """Blocks for up to ``n`` more tokens of ``seq``; returns how many it got, and
        the tokens that the sequences it preempted had been given in this step.

        A prefill chunk shrinks to the blocks that are free rather than throw away
        another sequence's work; only when not one token fits (always the case for a
        decode that needs a new block) are newer sequences preempted, newest first.
        """
        freed = 0
        while True:
            room = (len(seq.block_table) + self.kv.pool.num_free) * self.kv.block_size
            fit = min(n, room - self.kv.table_index(seq, seq.num_computed))
            if fit > 0:
                self.kv.ensure(seq, seq.num_computed + fit)
                return fit, freed
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            freed += sum(k for s, k in batch.work if s is victim)
            batch.work = [w for w in batch.work if w[0] is not victim]
            if victim is seq:
                return 0, freed

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence out to the host tier where it has room (its KV is kept),
        else free its blocks (its tokens are recomputed when it runs again). A swap that
        raises (a failed copy) changes nothing: the sequence stays running, and the
        failed step ends it."""
        if not self.kv.swap_out(seq):
            self.kv.free(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def slots_taken(self) -> int:
        """Sequences that count against ``max_num_seqs``: running and reserved."""
        return len(self.running) + len(self.reserved)

    def reserve(self, seq: Sequence) -> None:
        """Hold a slot for a sequence whose KV is on its way (its blocks are reserved);
        ``add_running`` once it has arrived."""
        self._arrived(seq)
        seq.status = Status.RESERVED
        self.reserved[seq.request_id] = seq

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already computed (it arrived from a prefill worker)."""
        self._arrived(seq)
        self.reserved.pop(seq.request_id, None)
        self._run(seq)

    def hold(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but keep its blocks (its KV awaits transfer)."""
        self.running.remove(seq)
        seq.status = Status.HELD

    def finish(self, seq: Sequence) -> None:
        """Free a sequence's blocks the moment it ends, whatever the reason."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RESERVED:
            del self.reserved[seq.request_id]
        self.kv.free(seq)
        seq.status = Status.FINISHED
