"""Where the router has a prompt prefilled: the policy's rule, and the relay that follows it."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import DisaggregationConfig, RouterConfig
from tandem.errors import ConfigError
from tandem.router.disaggregation import PrefillRouting
from tandem.router.placement import Pool, WorkerLoad
from tandem.router.server import SERVICE_NAME
from tests.router.fakes import FakeDecode, FakePrefill, cluster, wait_until

IDLE = WorkerLoad("p")
DECODE = WorkerLoad("d")
CONDITIONAL = {"mode": "conditional", "local_max_tokens": 8}


def _decide(tokens, prefill=(IDLE,), decode=DECODE, **config):
    return PrefillRouting(DisaggregationConfig(**{**CONDITIONAL, **config})).decide(
        tokens, list(prefill), decode
    )


def test_conditional_rule_step_by_step():
    assert _decide(8).reason == "short" and _decide(8).here
    assert _decide(9).reason == "long" and not _decide(9).here
    assert _decide(9, prefill=()).reason == "no prefill worker"
    busy = [WorkerLoad("p1", queue_depth=4), WorkerLoad("p2", queue_depth=5)]
    assert _decide(100, prefill=busy).reason == "prefill busy"
    # One prefill worker with room left is enough to send it there.
    assert _decide(100, prefill=[*busy, WorkerLoad("p3", queue_depth=3)]).reason == "long"
    # A decode worker running many streams would stall them all: keep the prefill away.
    assert _decide(100, prefill=busy, decode=WorkerLoad("d", running=9)).reason == "long"
    assert _decide(100, prefill=busy, decode=WorkerLoad("d", running=8)).here


def test_a_decode_worker_whose_streams_a_prefill_would_stall_too_long_does_not_prefill():
    # 2 ms a prompt token: 8 tokens stall its streams 16 ms.
    busy_decode = WorkerLoad("d", running=3, prefill_token_seconds=0.002)
    assert _decide(8, decode=busy_decode, local_max_stall_ms=17).reason == "short"
    assert _decide(8, decode=busy_decode, local_max_stall_ms=15).reason == "decode busy"
    assert not _decide(8, decode=busy_decode, local_max_stall_ms=15).here
    # Streams this router has just placed count as running ones.
    just_placed = WorkerLoad("d", inflight=1, prefill_token_seconds=0.002)
    assert _decide(8, decode=just_placed, local_max_stall_ms=15).reason == "decode busy"
    # No stream to stall, or no limit: the prefill's cost does not matter.
    idle = WorkerLoad("d", prefill_token_seconds=0.002)
    assert _decide(8, decode=idle, local_max_stall_ms=15).here
    assert _decide(8, decode=busy_decode, local_max_stall_ms=0).here
    # A busy prefill pool does not send a long prompt here either (9 tokens: 18 ms).
    busy = [WorkerLoad("p", queue_depth=4)]
    assert _decide(9, prefill=busy, decode=busy_decode, local_max_stall_ms=17).reason == "long"
    assert _decide(9, prefill=busy, decode=busy_decode, local_max_stall_ms=19).here
    # A worker that never prefilled has no per-token figure yet: it counts as free.
    assert _decide(8, decode=WorkerLoad("d", running=3), local_max_stall_ms=1).here


def test_prompts_sent_to_prefill_on_a_decode_worker_count_until_their_first_token():
    # A burst within one poll passed each check alone, then was computed in one step
    # that its streams waited out whole (and ran past local_max_running).
    pending = WorkerLoad("d", running=3, prefill_token_seconds=0.002, prefilling=1,
                         prefilling_tokens=4)  # fmt: skip
    assert _decide(4, decode=pending, local_max_stall_ms=17).reason == "short"  # 16 ms
    assert _decide(5, decode=pending, local_max_stall_ms=17).reason == "decode busy"  # 18 ms
    busy = [WorkerLoad("p", queue_depth=4)]
    six = WorkerLoad("d", running=3, prefilling=6)
    assert _decide(100, prefill=busy, decode=six).reason == "long"  # 9 > local_max_running
    assert _decide(100, prefill=busy, decode=WorkerLoad("d", running=3, prefilling=5)).here


def test_the_router_counts_its_local_prefills_until_their_first_token(frontend):
    async def scenario():
        config = DisaggregationConfig(mode="conditional", local_max_tokens=10_000)
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], disaggregation=config) as c:
            (worker,) = c.router.registry.workers(Pool.DECODE)
            calls = [asyncio.create_task(c.client.complete("hello " * 5, max_tokens=2))
                     for _ in range(3)]  # fmt: skip
            await wait_until(lambda: len(worker.prefilling) == 3, what="three pending")
            assert worker.load().prefilling == 3 and worker.load().prefilling_tokens > 0
            decode.gate.set()
            await asyncio.gather(*calls)
            assert worker.prefilling == {}

    run(scenario())


def test_modes_always_and_never_ignore_the_numbers():
    assert _decide(1, mode="always").reason == "always"
    assert not _decide(1, prefill=(), mode="always").here
    assert _decide(10_000, mode="never").here


def test_decisions_are_counted_by_reason():
    routing = PrefillRouting(DisaggregationConfig(**CONDITIONAL))
    for tokens in (1, 2, 100):
        routing.count(routing.decide(tokens, [IDLE], WorkerLoad("d")))
    routing.decide(3, [IDLE], WorkerLoad("d"))  # a decode worker that then refused
    assert routing.counts == {"short": 2, "long": 1}
    assert routing.describe() == "on the decode worker: 2 short; on the prefill pool: 1 long"


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="disaggregation.mode must be one of"):
        DisaggregationConfig(mode="sometimes")
    whole = "must be a whole number"
    with pytest.raises(ConfigError, match=f"disaggregation.local_max_tokens {whole} >= 0"):
        DisaggregationConfig(local_max_tokens=-1)
    with pytest.raises(ConfigError, match=f"disaggregation.local_max_tokens {whole} >= 0, "
                       "got 1.5"):  # fmt: skip
        DisaggregationConfig(local_max_tokens=1.5)
    # 0 read "an idle prefill pool is busy": long prompts stayed on the decode worker.
    with pytest.raises(ConfigError, match=f"disaggregation.prefill_queue_max {whole} >= 1"):
        DisaggregationConfig(prefill_queue_max=0)
    for stall in (-5, math.nan, math.inf):  # nan sent every short prompt away, unnoticed
        with pytest.raises(ConfigError, match="disaggregation.local_max_stall_ms must be "
                           "finite and >= 0"):  # fmt: skip
            DisaggregationConfig(local_max_stall_ms=stall)


def run(coro):
    return asyncio.run(coro)


def _tokens(chunks):
    return [t for ch in chunks for t in ch.token_ids]


def test_colocated_router_serves_with_no_prefill_pool_and_is_healthy(frontend):
    async def scenario():
        async with cluster(frontend, prefill=[], disaggregation=DisaggregationConfig(
                mode="never")) as c:  # fmt: skip
            chunks = [ch async for ch in c.client.generate("hello", max_tokens=5)]
            assert [ch.token_ids for ch in chunks] == [(10,), (11,), (12, 13), (14,)]
            assert "".join(ch.text for ch in chunks) == "<10><11><12><13><14>"
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == 5
            (call,) = c.decode[0].calls
            assert call.request.prefill_here
            assert c.router.relay.routing.counts == {"colocated": 1}
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(scenario())


def test_conditional_sends_short_prompts_to_decode_and_long_ones_to_prefill(frontend):
    async def scenario():
        config = DisaggregationConfig(mode="conditional", local_max_tokens=4)
        async with cluster(frontend, disaggregation=config) as c:
            short = [ch async for ch in c.client.generate("hi", max_tokens=5)]
            long = [ch async for ch in c.client.generate("a much longer prompt " * 4,
                                                          max_tokens=5)]  # fmt: skip
            assert _tokens(short) == _tokens(long) == [10, 11, 12, 13, 14]
            here = [call.request.prefill_here for call in c.decode[0].calls]
            assert here == [True, False]
            assert len(c.prefill[0].calls) == 1  # only the long one
            assert c.router.relay.routing.counts == {"short": 1, "long": 1}

    run(scenario())


def test_conditional_prefills_on_decode_when_the_prefill_pool_is_busy_or_gone(frontend):
    async def scenario():
        config = DisaggregationConfig(mode="conditional", local_max_tokens=0,
                                      prefill_queue_max=2)  # fmt: skip
        prefill = FakePrefill(queue_depth=2)
        async with cluster(frontend, prefill=[prefill], disaggregation=config) as c:
            await wait_until(lambda: c.router.registry.workers()[0].queue_depth == 2,
                             what="the busy prefill worker polled")  # fmt: skip
            chunks = [ch async for ch in c.client.generate("hello", max_tokens=5)]
            assert _tokens(chunks) == [10, 11, 12, 13, 14] and not prefill.calls
            await prefill.stop()
            await wait_until(lambda: not c.router.registry.placeable(c.router.registry
                             .workers()[0].pool), what="the prefill worker down")  # fmt: skip
            chunks = [ch async for ch in c.client.generate("hello", max_tokens=5)]
            assert _tokens(chunks) == [10, 11, 12, 13, 14]
            assert c.router.relay.routing.counts == {"prefill busy": 1, "no prefill worker": 1}

    run(scenario())


@pytest.mark.parametrize("max_migrations", [0, 2])
def test_a_prefill_pool_that_refuses_at_its_door_falls_back_to_the_decode_worker(
    frontend, max_migrations
):
    # Its only worker answers UNAVAILABLE (draining, or just gone; its Status still
    # answered at the last poll). The attempt was thrown away as a migration: with
    # max_migrations 0 the client got UNAVAILABLE, though the rule prefills on the
    # decode worker when the pool has no live worker.
    async def scenario():
        config = DisaggregationConfig(mode="conditional", local_max_tokens=8)
        refusing = FakePrefill(error=grpc.StatusCode.UNAVAILABLE)
        async with cluster(frontend, prefill=[refusing], status_interval_s=5.0,
                           max_migrations=max_migrations, disaggregation=config) as c:  # fmt: skip
            chunks = [ch async for ch in c.client.generate("hello " * 20, max_tokens=5)]
            assert _tokens(chunks) == [10, 11, 12, 13, 14]
            assert c.router.relay.routing.counts == {"long": 1, "no prefill worker": 1}
            assert c.router.relay.migrations == 0
            (decode,) = c.decode
            assert len(decode.calls) == 2  # the same decode worker, asked to prefill

    run(scenario())


def test_a_request_prefilled_on_decode_migrates_when_that_worker_dies(frontend):
    async def scenario():
        dying = FakeDecode(chunks=[([11], 0)], fail_with=grpc.StatusCode.UNAVAILABLE)
        decode = [dying, FakeDecode()]
        async with cluster(frontend, prefill=[], decode=decode,
                           disaggregation=DisaggregationConfig(mode="never")) as c:  # fmt: skip
            chunks = [ch async for ch in c.client.generate("hello", max_tokens=5)]
            assert _tokens(chunks) == [10, 11, 12, 13, 14]  # none lost, none twice
            (second,) = decode[1].calls
            assert list(second.request.request.output_token_ids) == [10, 11]
            assert second.request.prefill_here

    run(scenario())


def test_always_keeps_every_prompt_on_the_prefill_pool(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            [ch async for ch in c.client.generate("hi", max_tokens=5)]
            assert not c.decode[0].calls[0].request.prefill_here
            assert len(c.prefill[0].calls) == 1
            assert RouterConfig().disaggregation.mode == "always"

    run(scenario())


def test_conditional_with_prefix_aware_keeps_a_cached_long_prompt_on_decode(frontend):
    async def scenario():
        config = DisaggregationConfig(mode="conditional", local_max_tokens=16)
        async with cluster(frontend, disaggregation=config, placement="prefix-aware") as c:
            prompt = "the same long conversation so far " * 8  # well over 16 tokens
            for _ in range(2):
                chunks = [ch async for ch in c.client.generate(prompt, max_tokens=5)]
                assert _tokens(chunks) == [10, 11, 12, 13, 14]
            # First: nothing cached, shipped. Second: the decode worker holds all but
            # the last block, so prefilling there computes <= 16 tokens.
            assert [call.request.prefill_here for call in c.decode[0].calls] == [False, True]
            assert c.router.relay.routing.counts == {"long": 1, "short": 1}

    run(scenario())


def test_prefix_aware_learns_the_reply_a_decode_worker_generated(frontend):
    async def scenario():
        async with cluster(frontend, placement="prefix-aware") as c:
            prompt = "a conversation long enough to fill some blocks " * 4
            chunks = [ch async for ch in c.client.generate(prompt, max_tokens=5)]
            policy = c.router.relay.policy
            prompt_ids = frontend.tokenizer.encode(prompt)
            sequence = [*prompt_ids, *_tokens(chunks)]
            held = policy._history[Pool.DECODE][c.decode[0].address]
            # Every full block up to the reply's last token: what the worker cached,
            # more than the prompt's own.
            assert set(held) == set(policy._hashes(sequence))
            assert len(held) == (len(sequence) - 1) // 16  # all but the last token computed
            assert len(held) > len(policy._hashes(prompt_ids))

    run(scenario())


def test_a_decode_worker_that_refused_a_prompt_is_not_taken_to_hold_it(frontend):
    # A pick was recorded as a placement: a worker that refused the reservation at its
    # door (computing nothing) was taken to hold the whole prompt, the next request
    # with it went there as "short", and that worker computed all of it while its
    # streams waited.
    async def scenario():
        refusing = FakeDecode(open_error=grpc.StatusCode.RESOURCE_EXHAUSTED, kv_blocks_free=1000)
        serving = FakeDecode(kv_blocks_free=800)
        config = DisaggregationConfig(mode="conditional", local_max_tokens=16)
        async with cluster(frontend, decode=[refusing, serving], disaggregation=config,
                           placement="prefix-aware") as c:  # fmt: skip
            await wait_until(lambda: all(w.kv_block_size for w in c.router.registry.workers()),
                             what="a poll")  # fmt: skip
            prompt = "the same long conversation so far " * 8  # well over 16 tokens
            await c.client.complete(prompt, max_tokens=5)
            refusing.open_error = None  # room now
            await c.client.complete(prompt, max_tokens=5)
            # It goes where the prompt is: the worker that served it, prefilled there.
            assert len(refusing.calls) == 1
            assert [call.request.prefill_here for call in serving.calls] == [False, True]
            assert c.router.relay.routing.counts == {"long": 1, "short": 1}

    run(scenario())
