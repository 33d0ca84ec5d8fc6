"""Worker membership and health: Status polling, drops, returns, run-time add/remove."""

from __future__ import annotations

import asyncio

from tandem.router import Pool
from tests.router.fakes import FakeDecode, FakePrefill, cluster, serve, wait_until


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
