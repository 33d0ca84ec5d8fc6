"""The router's metrics, scraped over HTTP as Prometheus does, after scripted requests."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import pytest

from tandem import logs
from tandem.client.errors import DeadlineExceeded, InvalidRequest, Overloaded, Unavailable
from tandem.metrics.scrape import scrape, total
from tests.router.fakes import FakeDecode, FakePrefill, cluster, wait_until


def run(coro):
    return asyncio.run(coro)


async def _scrape(c) -> list:
    return await asyncio.to_thread(scrape, c.router.metrics_address)


def test_a_served_request_is_counted_once_with_its_usage_and_timings(frontend):
    async def scenario():
        async with cluster(frontend, metrics_port=0) as c:
            chunks = [ch async for ch in c.client.generate(prompt="hi there", max_tokens=4)]
            samples = await _scrape(c)
            usage = chunks[-1].usage
            m = {"model": "tiny-random"}
            assert total(samples, "tandem_router_requests_total", code="OK",
                         finish_reason="length", **m) == 1  # fmt: skip
            assert total(samples, "tandem_router_prompt_tokens_total", **m) == usage.prompt_tokens
            assert total(samples, "tandem_router_generation_tokens_total",
                         **m) == usage.completion_tokens == 5  # the fake's script  # fmt: skip
            for name in ("time_to_first_token", "e2e_request_latency", "queue_time",
                         "time_per_output_token"):  # fmt: skip
                assert total(samples, f"tandem_router_{name}_seconds_count", **m) == 1, name
            # The first token, then the fake's chunks [11], [12, 13], [14]: 3 gaps.
            assert len(chunks) == 4
            assert total(samples, "tandem_router_inter_token_latency_seconds_count") == 3
            assert total(samples, "tandem_router_requests_in_flight") == 0
            assert total(samples, "tandem_router_prefill_decisions_total",
                         where="prefill_pool", reason="always") == 1  # fmt: skip
            up = {s.labels["role"]: s.value for s in samples
                  if s.name == "tandem_router_worker_up"}  # fmt: skip
            assert up == {"prefill": 1.0, "decode": 1.0}
            info = [s.labels for s in samples if s.name == "tandem_router_worker_info"]
            assert {i["worker_id"] for i in info} == {w.address for w in c.prefill + c.decode}

    run(scenario())


def test_a_client_deadline_is_counted_as_such_and_a_cancel_as_a_cancel(frontend):
    # Both ended the handler the same way, and both were counted CANCELLED: the
    # dashboard could not tell timeouts from callers who left.
    async def scenario():
        async with cluster(frontend, decode=[FakeDecode(gate=asyncio.Event())],
                           metrics_port=0) as c:  # fmt: skip
            with pytest.raises(DeadlineExceeded):
                await c.client.complete(prompt="hi", max_tokens=4, timeout=0.5)
            left = asyncio.ensure_future(c.client.complete(prompt="hi", max_tokens=4))
            await wait_until(lambda: len(c.decode[0].calls) == 2, what="the second in flight")
            left.cancel()
            for _ in range(100):  # until the router has counted both
                samples = await _scrape(c)
                if total(samples, "tandem_router_requests_total") == 2:
                    break
                await asyncio.sleep(0.05)
        codes = {s.labels["code"]: s.value for s in samples
                 if s.name == "tandem_router_requests_total"}  # fmt: skip
        assert codes == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 1}

    run(scenario())


def test_failures_are_counted_by_code_and_rejections_by_the_limit(frontend):
    async def scenario():
        gate = asyncio.Event()
        async with cluster(frontend, decode=[FakeDecode(gate=gate)], max_queue=1,
                           metrics_port=0) as c:  # fmt: skip
            with pytest.raises(InvalidRequest):
                await c.client.complete(prompt="hi", max_tokens=0)
            held = asyncio.ensure_future(c.client.complete(prompt="hi", max_tokens=4))
            await wait_until(lambda: c.decode[0].calls, what="the first request in flight")
            with pytest.raises(Overloaded):
                await c.client.complete(prompt="hi", max_tokens=4)
            gate.set()
            await held
            samples = await _scrape(c)
        requests = {(s.labels["code"], s.labels["finish_reason"]): s.value for s in samples
                    if s.name == "tandem_router_requests_total"}  # fmt: skip
        assert requests == {("INVALID_ARGUMENT", "none"): 1, ("RESOURCE_EXHAUSTED", "none"): 1,
                            ("OK", "length"): 1}  # fmt: skip
        assert total(samples, "tandem_router_admission_rejections_total",
                     reason="router_queue") == 1  # fmt: skip
        assert total(samples, "tandem_router_time_to_first_token_seconds_count") == 1

    run(scenario())


def test_a_retry_on_another_worker_is_counted_by_role(frontend):
    async def scenario():
        prefill = [FakePrefill(error=grpc.StatusCode.UNAVAILABLE), FakePrefill()]
        async with cluster(frontend, prefill=prefill, placement="round-robin",
                           metrics_port=0) as c:  # fmt: skip
            for _ in range(2):
                await c.client.complete(prompt="hi", max_tokens=4)
            samples = await _scrape(c)
        assert total(samples, "tandem_router_worker_retries_total", role="prefill") >= 1
        assert total(samples, "tandem_router_requests_total", code="OK") == 2

    run(scenario())


@dataclass
class FullFirst(FakeDecode):
    """Refuses its first ``full_for`` Decode calls for lack of KV room."""

    full_for: int = 0

    async def Decode(self, request, context):
        if self.full_for > 0:
            self.full_for -= 1
            self._record(request, context)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV room")
        async for response in super().Decode(request, context):
            yield response


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "with-another"])
def test_a_request_is_one_prefill_decision_and_a_retry_needs_another_worker(frontend, others):
    # A full decode worker tried first: the request waits for room there (alone) or
    # goes to the other. Either way one decision says where it was prefilled, and a
    # retry is counted only when another worker took the call.
    async def scenario():
        decode = [FullFirst(full_for=3, kv_blocks_free=5000), *[FakeDecode()] * others]
        async with cluster(frontend, decode=decode, metrics_port=0) as c:
            await c.router.registry.poll_once()
            await c.client.complete(prompt="hi", max_tokens=4)
            samples = await _scrape(c)
        assert total(samples, "tandem_router_prefill_decisions_total") == 1
        assert total(samples, "tandem_router_worker_retries_total", role="decode") == others

    run(scenario())


def test_a_failed_request_is_logged_with_its_request_id(frontend, caplog):
    caplog.handler.addFilter(logs._RequestId())  # what every process's handler does

    async def scenario():
        async with cluster(frontend, decode=[]) as c:
            with pytest.raises(Unavailable):
                await c.client.complete(prompt="hi", max_tokens=4, request_id="req-42")

    with caplog.at_level(logging.INFO, logger="tandem.router"):
        run(scenario())
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed and all(r.request_id == "req-42" for r in failed)
    assert failed[0].request == " [request=req-42]"
