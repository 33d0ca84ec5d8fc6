"""Worker membership and health: Status polling, drops, returns, run-time add/remove."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tandem.router import Pool
from tandem.router.registry import Worker, WorkerRegistry
from tests.router.fakes import FakeDecode, FakePrefill, SlowStatus, cluster, serve, wait_until


def run(coro):
    return asyncio.run(coro)


def healthy(c, pool: Pool) -> list[str]:
    return [w.address for w in c.router.registry.placeable(pool)]


def test_least_loaded_follows_polled_status(frontend):
    async def scenario():
        small, big = FakeDecode(kv_blocks_free=100), FakeDecode(kv_blocks_free=900)
        busy, idle = FakePrefill(queue_depth=4), FakePrefill(queue_depth=0)
        async with cluster(frontend, [busy, idle], [small, big]) as c:
            await c.router.registry.poll_once()
            await c.client.complete("hello")
            assert (len(small.calls), len(big.calls)) == (0, 1)
            assert (len(busy.calls), len(idle.calls)) == (0, 1)

    run(scenario())


def test_concurrent_burst_spreads_over_equal_workers(frontend):
    async def scenario():
        gate = asyncio.Event()
        decode = [FakeDecode(gate=gate), FakeDecode(gate=gate)]
        async with cluster(frontend, [FakePrefill(), FakePrefill()], decode) as c:
            await c.router.registry.poll_once()
            tasks = [asyncio.create_task(c.client.complete("hello")) for _ in range(8)]
            await wait_until(lambda: c.worker_calls() == 16, what="all placed")
            gate.set()
            done = await asyncio.gather(*tasks)
            assert [d.finish_reason for d in done] == ["length"] * 8
            assert all(len(w.calls) >= 2 for w in decode)

    run(scenario())


def test_status_failure_drops_a_worker_and_an_answer_takes_it_back(frontend):
    async def scenario():
        flaky = FakeDecode(kv_blocks_free=5000)
        async with cluster(frontend, decode=[flaky, FakeDecode()]) as c:
            flaky.status_fails = True
            await wait_until(lambda: flaky.address not in healthy(c, Pool.DECODE), what="drop")
            await c.client.complete("hello")
            assert (len(flaky.calls), len(c.decode[1].calls)) == (0, 1)
            flaky.status_fails = False
            await wait_until(lambda: flaky.address in healthy(c, Pool.DECODE), what="return")
            await c.client.complete("hello")
            assert len(flaky.calls) == 1

    run(scenario())


def test_a_worker_registered_in_the_wrong_pool_is_not_used(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            c.router.add_worker(Pool.DECODE, c.prefill[0].address)
            await c.router.registry.poll_once()
            assert healthy(c, Pool.DECODE) == [c.decode[0].address]

    run(scenario())


def test_workers_added_and_removed_at_run_time(frontend):
    async def scenario():
        async with cluster(frontend, placement="round-robin") as c:
            extra = await serve(FakeDecode())
            try:
                c.router.add_worker("decode", extra.address)
                c.router.add_worker("decode", extra.address)  # idempotent
                assert healthy(c, Pool.DECODE) == [c.decode[0].address, extra.address]
                for _ in range(4):
                    await c.client.complete("hello")
                assert (len(c.decode[0].calls), len(extra.calls)) == (2, 2)
                assert c.router.remove_worker("decode", c.decode[0].address)
                assert not c.router.remove_worker("decode", c.decode[0].address)
                for _ in range(2):
                    await c.client.complete("hello")
                assert (len(c.decode[0].calls), len(extra.calls)) == (2, 4)
            finally:
                await extra.stop()

    run(scenario())


def test_removing_a_worker_lets_its_running_request_finish(frontend):
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode]) as c:
            task = asyncio.create_task(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="placed")
            c.router.remove_worker("decode", decode.address)
            decode.gate.set()
            assert (await task).token_ids == (10, 11, 12, 13, 14)

    run(scenario())


def test_a_status_reply_the_router_cannot_read_takes_out_its_worker_not_the_poller(frontend):
    # A role this version does not know (another version's worker): before, the
    # exception ended the poller, and no worker's health changed again.
    async def scenario():
        good = FakeDecode()
        async with cluster(frontend, decode=[good], status_interval_s=0.05) as c:
            odd = await serve(FakeDecode(role=7))
            try:
                c.router.add_worker("decode", odd.address)
                await wait_until(lambda: odd.address not in healthy(c, Pool.DECODE), what="odd")
                good.status_fails = True
                await wait_until(lambda: good.address not in healthy(c, Pool.DECODE), what="drop")
                good.status_fails = False
                await wait_until(lambda: good.address in healthy(c, Pool.DECODE), what="return")
                assert not c.router.registry._poller.done()
            finally:
                await odd.stop()

    run(scenario())


def test_a_worker_removed_while_its_status_is_on_its_way_leaves_the_poller_running(frontend):
    # Its channel closes, and grpc ends the call with CancelledError, which ended the
    # poller for good: no worker's health or load changed again.
    async def scenario():
        good = FakeDecode()
        async with cluster(frontend, decode=[good], status_interval_s=0.05) as c:
            slow = await serve(SlowStatus())
            try:
                c.router.add_worker("decode", slow.address)
                await asyncio.sleep(0.3)  # the round waits on its Status
                assert c.router.remove_worker("decode", slow.address)
                good.status_fails = True
                await wait_until(lambda: good.address not in healthy(c, Pool.DECODE), what="drop")
                assert not c.router.registry._poller.done()
            finally:
                await slow.stop()

    run(scenario())


@dataclass
class LiveQueue(FakePrefill):
    """Reports the calls it holds as its queue, as a worker between steps does."""

    async def Status(self, request, context):
        self.queue_depth = sum(not call.finished and call.cancelled_at is None
                               for call in self.calls)  # fmt: skip
        return await super().Status(request, context)


class LiveRunning(FakePrefill):
    """Reports the calls it holds as running."""

    async def Status(self, request, context):
        self.running = sum(not call.finished and call.cancelled_at is None
                           for call in self.calls)  # fmt: skip
        return await super().Status(request, context)


def test_a_worker_polled_mid_request_is_idle_again_when_the_request_ends(frontend):
    # Its Status said running 1; once that request was done, every request until the
    # next poll went to the other worker, as though it were still busy.
    async def scenario():
        workers = [LiveRunning(delay_s=0.3), LiveRunning(delay_s=0.3)]
        async with cluster(frontend, workers, status_interval_s=60) as c:
            first = asyncio.ensure_future(c.client.complete("hello"))
            await wait_until(lambda: any(w.calls for w in workers), what="placed")
            await c.router.registry.poll_once()  # it is running there now
            await first
            for _ in range(4):
                await c.client.complete("hello")
            assert [len(w.calls) for w in workers] in ([3, 2], [2, 3])

    run(scenario())


def test_a_worker_whose_status_lags_its_requests_is_not_piled_onto(frontend):
    # A worker answers Status with numbers from before its current step (here: one
    # that never ends, so it always reports an empty queue); the requests it got
    # since are in the router's in-flight count only. Before, every poll erased
    # them, and the lagging worker took nearly every request.
    async def scenario():
        lagging, live = FakePrefill(delay_s=2.0), LiveQueue(delay_s=2.0)
        async with cluster(frontend, [lagging, live], status_interval_s=0.02) as c:
            tasks = []
            for _ in range(10):
                tasks.append(asyncio.create_task(c.client.complete("hello")))
                await asyncio.sleep(0.05)  # a poll between any two
            await asyncio.gather(*tasks)
            assert 4 <= len(lagging.calls) <= 6, (len(lagging.calls), len(live.calls))

    run(scenario())


def test_a_prefill_worker_only_shipping_kv_is_not_counted_as_busy():
    # Its first tokens are back: its engine computes nothing more for those calls.
    worker = Worker("a", Pool.PREFILL, channel=None, stub=None, last_ok=0.0, inflight=4)
    assert worker.load().queue_depth == 4  # waiting for their first tokens
    worker.shipping = 3
    assert worker.load().queue_depth == 1


def test_a_call_whose_kv_is_on_its_way_counts_apart_until_it_ends(frontend):
    async def scenario():
        prefill = FakePrefill(kv_delay_s=1.0)
        async with cluster(frontend, [prefill], status_interval_s=60) as c:
            (worker,) = c.router.registry.workers(Pool.PREFILL)
            done = asyncio.ensure_future(c.client.complete("hello"))
            await wait_until(lambda: worker.shipping == 1, what="its first token back")
            assert worker.inflight == 1 and worker.load().queue_depth == 0
            await done
            await wait_until(lambda: worker.inflight == 0, what="the call's end")
            assert worker.shipping == 0

    run(scenario())


def test_a_worker_down_removed_or_restarted_is_forgotten_by_prefix_placement(frontend):
    # Its prefix cache is gone: a decision counting on it (conditional prefill's
    # "cached, so short") would cost the restarted worker a whole prompt's prefill.
    async def scenario():
        decode = [FakeDecode(prefix_query_tokens=500), FakeDecode(prefix_query_tokens=500)]
        async with cluster(frontend, decode=decode, placement="prefix-aware",
                           status_interval_s=0.02) as c:  # fmt: skip
            history = c.router.relay.policy._history[Pool.DECODE]
            prompt = "a prompt that fills several blocks " * 8

            async def placed_on() -> str:
                await c.client.complete(prompt)
                (address,) = [w.address for w in decode if w.address in history]
                return address

            first = await placed_on()
            worker = next(w for w in decode if w.address == first)
            worker.prefix_query_tokens = 3  # its counters since start went back
            await wait_until(lambda: first not in history, what="restart forgotten")
            second = await placed_on()
            worker = next(w for w in decode if w.address == second)
            worker.status_fails = True
            await wait_until(lambda: second not in history, what="down forgotten")
            worker.status_fails = False
            await wait_until(lambda: second in healthy(c, Pool.DECODE), what="back")
            third = await placed_on()
            assert c.router.registry.remove_worker(Pool.DECODE, third)
            assert third not in history

    run(scenario())


def test_prefix_placement_hashes_in_the_block_size_a_worker_reports(frontend):
    # A worker's prefix cache holds whole blocks of its engine.block_size; one that
    # comes back with another size holds none of what the router remembers.
    async def scenario():
        decode = FakeDecode(kv_block_size=32)
        async with cluster(frontend, decode=[decode], placement="prefix-aware",
                           status_interval_s=0.02) as c:  # fmt: skip
            history = c.router.relay.policy._history[Pool.DECODE]
            await c.client.complete("a prompt that fills several blocks " * 8)
            sent = decode.calls[0].request.request
            policy, held = c.router.relay.policy, set(history[decode.address])
            assert set(policy._hashes(sent.prompt_token_ids, sent.cache_salt, 32)) <= held
            assert not set(policy._hashes(sent.prompt_token_ids, sent.cache_salt, 16)) & held
            decode.kv_block_size = 64
            await wait_until(lambda: decode.address not in history, what="forgotten")

    run(scenario())


class SlowLiveQueue(FakePrefill):
    """Reports the calls it holds as its queue, counted as its Status answers, late."""

    async def Status(self, request, context):
        await asyncio.sleep(0.3)
        self.queue_depth = sum(not call.finished and call.cancelled_at is None
                               for call in self.calls)  # fmt: skip
        return await super().Status(request, context)


def test_a_call_placed_while_a_status_is_on_its_way_is_counted_once(frontend):
    # It reached the worker before the answer, so the numbers hold it: counted again as
    # "placed since", the worker looked twice as busy until the next poll.
    async def scenario():
        slow = SlowLiveQueue(delay_s=2.0)
        async with cluster(frontend, [slow], status_interval_s=60) as c:
            (worker,) = c.router.registry.workers(Pool.PREFILL)
            polled = asyncio.ensure_future(c.router.registry.poll_once())
            await asyncio.sleep(0.05)  # the Status is asked for
            request = asyncio.ensure_future(c.client.complete("hello"))
            await wait_until(lambda: len(slow.calls) == 1, what="placed")
            await polled
            assert (worker.queue_depth, worker.inflight) == (1, 1)
            load = worker.load()
            assert load.queue_depth + load.running == 1
            await request

    run(scenario())


def test_history_hashed_before_a_workers_block_size_was_known_is_forgotten(frontend):
    async def scenario():
        decode = FakeDecode(kv_block_size=32)
        async with cluster(frontend, decode=[decode], placement="prefix-aware",
                           status_interval_s=60) as c:  # fmt: skip
            (worker,) = c.router.registry.workers(Pool.DECODE)
            policy = c.router.relay.policy
            worker.kv_block_size = 0  # as before its first Status: placed in blocks of 16
            policy.pick(Pool.DECODE, [worker.load()], list(range(100)))
            policy.holds(Pool.DECODE, decode.address, list(range(100)))  # it took the request
            assert policy._history[Pool.DECODE][decode.address]
            await c.router.registry.poll_once()
            assert decode.address not in policy._history[Pool.DECODE]
            assert worker.kv_block_size == 32

    run(scenario())


def test_the_workers_can_be_listed_while_the_pool_changes():
    """The metrics endpoint lists the workers on its own thread while the event loop adds
    and removes them: a change between two steps of the listing must not break it (it
    answered a scrape 500 "dictionary changed size during iteration")."""
    registry = WorkerRegistry(status_interval_s=1.0, worker_timeout_s=10.0)

    class Joins:  # a worker whose read lets another one join, as a thread switch would
        @property
        def pool(self):
            registry._workers[(Pool.DECODE, f"late-{len(registry._workers)}")] = Joins()
            return Pool.DECODE

    registry._workers[(Pool.DECODE, "first")] = Joins()
    assert len(registry.workers(Pool.DECODE)) == 1
