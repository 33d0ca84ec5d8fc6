"""The router's other services: health, reflection, model info, tokenize, and draining."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import ChatMessage, Unavailable
from tandem.config import RouterConfig
from tandem.errors import ConfigError
from tandem.router import Router
from tests.router.fakes import LENGTH, FakeDecode, cluster, serve, wait_until


def run(coro):
    return asyncio.run(coro)


def test_health_is_serving_through_the_standard_client(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", "tandem.v1.Tandem"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    # Watch too: gRPC's client-side health checking streams it.
                    watch = stub.Watch(health_pb2.HealthCheckRequest(service=service))
                    first = await watch.read()
                    watch.cancel()
                    assert first.status == health_pb2.HealthCheckResponse.SERVING

    run(scenario())


def test_the_service_is_not_serving_while_a_pool_is_empty(frontend):
    async def scenario():
        async with cluster(frontend, decode=[]) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def check(service: str) -> int:
                    request = health_pb2.HealthCheckRequest(service=service)
                    return (await stub.Check(request)).status

                status = health_pb2.HealthCheckResponse
                assert await check("") == status.SERVING
                assert await check("tandem.v1.Tandem") == status.NOT_SERVING
                decode = await serve(FakeDecode())
                try:
                    c.router.add_worker("decode", decode.address)
                    deadline = asyncio.get_running_loop().time() + 2
                    while await check("tandem.v1.Tandem") != status.SERVING:
                        assert asyncio.get_running_loop().time() < deadline, "still NOT_SERVING"
                        await asyncio.sleep(0.02)
                finally:
                    await decode.stop()

    run(scenario())


def test_reflection_lists_the_public_service(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                async for reply in stub.ServerReflectionInfo(iter([request])):
                    names = {s.name for s in reply.list_services_response.service}
                    break
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names

    run(scenario())


def test_model_info_and_tokenize(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            info = await c.client.model_info()
            assert (info.model_id, info.context_length, info.vocab_size) == (
                "tiny-random",
                4096,
                frontend.vocab_size,
            )
            assert await c.client.tokenize("hello") == frontend.tokenizer.encode("hello")
            messages = [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}]
            expected = frontend.tokenizer.encode_chat(
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
            )
            assert await c.client.tokenize(messages=messages) == expected
            assert c.worker_calls() == 0

    run(scenario())


def test_stop_drains_in_flight_requests(frontend):
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode]) as c:
            task = asyncio.create_task(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="placed")
            stopping = asyncio.create_task(c.router.stop(grace=5))
            await asyncio.sleep(0.1)
            decode.gate.set()
            assert (await task).finish_reason == "length"
            await stopping

    run(scenario())


def test_an_open_health_watch_does_not_hold_the_drain(frontend):
    # gRPC's graceful stop waits for every call, and a Watch (client-side health
    # checking, a sidecar) never ends: each stop took the whole drain grace.
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode]) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service="")
                )
                await watch.read()
                task = asyncio.create_task(c.client.complete("hello"))
                await wait_until(lambda: decode.calls, what="placed")
                loop = asyncio.get_running_loop()
                start = loop.time()
                stopping = asyncio.create_task(c.router.stop(grace=20))
                await asyncio.sleep(0.3)
                with pytest.raises(Unavailable, match="the router is stopping"):
                    await c.client.complete("a newcomer")  # refused while it drains
                decode.gate.set()
                assert (await task).finish_reason == "length"  # the request still drains
                await stopping
                assert loop.time() - start < 5

    run(scenario())


def test_a_client_that_stops_reading_its_stream_is_let_go(frontend):
    # It held its place in max_queue (and its key's max_streams) for as long as it
    # kept the call open, the decode worker long done.
    bulk = FakeDecode(chunks=[([11], 0)] * 2000 + [([14], LENGTH)], text_padding=1000)

    async def scenario():
        async with cluster(frontend, decode=[bulk], stream_stall_timeout_s=1.0) as c:
            # No BDP probe: the window stays at 64 KiB, which the stream fills.
            options = [("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(c.router.address, options) as channel:
                call = tandem_pb2_grpc.TandemStub(channel).Generate(tandem_pb2.GenerateRequest(
                    prompt="hi", sampling=tandem_pb2.SamplingParams(max_tokens=2002)
                ))  # fmt: skip
                await call.read()
                await wait_until(lambda: c.router.admission.in_flight == 0, timeout=20,
                                 what="the stalled stream let go")  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as info:  # what it reads then
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert info.value.code() is grpc.StatusCode.CANCELLED
                assert "took no response for 1 s (stream_stall_timeout_s)" in info.value.details()

    run(scenario())


# A client's HTTP/2 connection preface, an empty SETTINGS frame and the ACK of the
# server's: a connection ready for calls, which makes none.
def test_health_watch_streams_are_bounded_across_the_server(frontend, monkeypatch):
    # No key is needed for health, and each Watch stays open for up to a connection's
    # age and grace: without a bound, connections times 1,024 streams each.
    from tandem.router import public_port

    monkeypatch.setattr(public_port, "MAX_HEALTH_WATCHES", 2)

    async def scenario():
        async with cluster(frontend) as c:
            channels = [grpc.aio.insecure_channel(c.router.address) for _ in range(2)]
            stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]
            request = health_pb2.HealthCheckRequest(service="")
            watches = [stubs[0].Watch(request), stubs[1].Watch(request)]
            for watch in watches:
                await watch.read()
            refused = stubs[1].Watch(request)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await refused.read()
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 Health.Watch streams are open" in info.value.details()
            assert (await stubs[1].Check(request)).status == health_pb2.HealthCheckResponse.SERVING
            watches[0].cancel()  # its room goes to the next
            await wait_until(lambda: c.router._health._watches == 1, what="watch ended")
            again = stubs[1].Watch(request)
            assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
            again.cancel()
            for channel in channels:
                await channel.close()

    run(scenario())


_IDLE_CLIENT = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
                + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")  # fmt: skip


def test_a_connection_that_makes_no_call_is_closed(frontend, monkeypatch):
    # gRPC kept one for good, no key needed, each a descriptor of the router: enough of
    # them and neither the gRPC nor the HTTP port served anyone.
    from tandem.router import public_port

    monkeypatch.setattr(public_port, "IDLE_CONNECTION_S", 1.0)

    async def scenario():
        async with cluster(frontend) as c:
            host, port = c.router.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_IDLE_CLIENT)
            loop = asyncio.get_running_loop()
            start = loop.time()
            while await asyncio.wait_for(reader.read(65536), 20):  # frames, then the close
                pass
            assert loop.time() - start < 10
            writer.close()
            assert (await c.client.complete("hi")).finish_reason == "length"  # still serves

    run(scenario())


def test_a_connection_that_made_a_call_is_closed_in_time(frontend, monkeypatch):
    # grpc.aio closes an idle connection only if it never made a call: one Health.Check
    # (no key needed) and a connection stayed for good, so that enough of them locked
    # every client out of the port.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.router import public_port

    monkeypatch.setattr(public_port, "MAX_CONNECTION_AGE_S", 1.0)

    async def scenario():
        async with cluster(frontend) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert channel.get_state() is grpc.ChannelConnectivity.READY
                await asyncio.sleep(5)  # idle, past the age (and its jitter)
                assert channel.get_state() is not grpc.ChannelConnectivity.READY

    run(scenario())


def test_the_public_grpc_port_bounds_its_connections():
    from tandem.router.public_port import grpc_connection_options

    options = dict(grpc_connection_options())
    assert options["grpc.max_connection_idle_ms"] == 120_000
    assert options["grpc.max_connection_age_ms"] == 600_000
    assert options["grpc.max_concurrent_streams"] == 1024
    assert 64 <= options["grpc.max_allowed_incoming_connections"] <= 8192
    assert options["grpc.keepalive_time_ms"] == 60_000  # a frozen client is let go


def test_a_taken_port_fails_at_start_naming_the_setting(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            taken = RouterConfig(model="tiny-random", port=c.router.port)
            with pytest.raises(ConfigError, match="router cannot listen on 127.0.0.1:.*port"):
                await Router(taken, frontend=frontend).start()

    run(scenario())


def test_the_router_raises_its_descriptor_limit_to_the_hard_one():
    # A shell's soft limit (1024) capped the gRPC port at 256 connections; the 257th
    # client was refused with what reads like a network fault.
    import resource

    from tandem.router.public_port import raise_descriptor_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        raised = raise_descriptor_limit()
        assert raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raised == hard or hard == resource.RLIM_INFINITY or hard <= 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
