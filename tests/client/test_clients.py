"""TandemClient and AsyncTandemClient against a scripted server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from tandem.client import (
    AlreadyInFlight,
    AsyncTandemClient,
    Cancelled,
    Completion,
    DeadlineExceeded,
    InvalidRequest,
    ModelInfo,
    Overloaded,
    TandemClient,
    Unavailable,
    Usage,
    _convert,
)


def test_sync_generate_streams_chunks_then_usage(fake):
    with TandemClient(fake.address) as client:
        chunks = list(client.generate("hi", max_tokens=3, temperature=0))
    assert [(c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        ("Hel", (1, 2), None),
        ("lo", (3,), "stop"),
    ]
    assert chunks[-1].usage == Usage(4, 3)
    sent = fake.servicer.requests[0]
    assert sent.prompt == "hi" and sent.sampling.max_tokens == 3


def test_sync_complete_model_info_tokenize(fake):
    with TandemClient(fake.address) as client:
        done = client.complete(messages=[{"role": "user", "content": "hi"}])
        assert done == Completion("r1", "Hello", (1, 2, 3), "stop", Usage(4, 3))
        assert client.model_info() == ModelInfo("m", 2048, 100)
        assert client.tokenize("hi") == [5, 6]


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.ALREADY_EXISTS, AlreadyInFlight),
    ],
)
def test_sync_statuses_raise_their_exception(fake, code, cls):
    fake.servicer.abort = (code, "top_p must be in (0, 1], got 2.0")
    with TandemClient(fake.address) as client:
        with pytest.raises(cls, match=r"top_p must be in \(0, 1\], got 2.0"):
            list(client.generate("hi"))
        with pytest.raises(cls):
            client.tokenize("hi")


@pytest.mark.parametrize(
    "trailers, seconds",
    [
        ((("grpc-retry-pushback-ms", "1500"),), 1.5),
        ((), None),
        ((("grpc-retry-pushback-ms", "-1"),), None),  # gRFC A6: not a wait to honour
    ],
)
def test_an_overload_carries_the_routers_retry_pushback(fake, trailers, seconds):
    fake.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    fake.servicer.trailers = trailers
    with TandemClient(fake.address) as client:
        for call in (lambda: list(client.generate("hi")), lambda: client.tokenize("hi")):
            with pytest.raises(Overloaded) as info:
                call()
            assert info.value.retry_after_s == seconds

    async def scenario():
        async with AsyncTandemClient(fake.address) as client:
            with pytest.raises(Overloaded) as info:
                await client.complete("hi")
            assert info.value.retry_after_s == seconds

    asyncio.run(scenario())


def test_sync_timeout_is_the_deadline(fake):
    fake.servicer.hang = True
    # 2 s, not less: the server must see the call while some of its deadline is left.
    with TandemClient(fake.address, timeout=2.0) as client:
        with pytest.raises(DeadlineExceeded):
            list(client.generate("hi"))
    assert 0 < fake.servicer.time_remaining <= 2.05  # the wire rounds deadlines up a little
    assert fake.servicer.cancelled.wait(30)


def test_sync_leaving_the_loop_early_cancels_the_call(fake):
    fake.servicer.hang = True
    with TandemClient(fake.address) as client:
        stream = client.generate("hi")
        assert next(stream).text == "Hel"
        stream.close()
        assert fake.servicer.cancelled.wait(30)


def test_async_client(fake):
    async def scenario():
        async with AsyncTandemClient(fake.address) as client:
            chunks = [c async for c in client.generate("hi", seed=1)]
            assert [c.text for c in chunks] == ["Hel", "lo"]
            assert (await client.complete("hi")).usage == Usage(4, 3)
            assert await client.model_info() == ModelInfo("m", 2048, 100)
            assert await client.tokenize(messages=[{"role": "user", "content": "x"}]) == [5, 6]
            fake.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            with pytest.raises(Overloaded, match="queue full"):
                await client.complete("hi")
            fake.servicer.abort, fake.servicer.hang = None, True
            with pytest.raises(DeadlineExceeded):
                await client.complete("hi", timeout=0.3)
        assert fake.servicer.cancelled.wait(30)

    asyncio.run(scenario())


def test_an_async_client_made_before_the_event_loop_runs_works_in_it(fake):
    # The usual module-level client: a gRPC aio channel belongs to the loop it was made
    # in, so it is made on first use.
    client = AsyncTandemClient(fake.address, timeout=10)

    async def use():
        async with client:
            return await client.complete("hi")

    assert asyncio.run(use()).text == "Hello"


def test_an_async_client_serves_several_event_loops_and_refuses_use_once_closed(fake):
    # The channel belonged to the first asyncio.run's loop: the second run failed with
    # "Event loop is closed".
    client = AsyncTandemClient(fake.address, timeout=10)
    for _ in range(2):
        assert asyncio.run(client.complete("hi")).text == "Hello"

    async def closed():
        await client.close()
        with pytest.raises(ValueError, match="this client is closed"):
            await client.complete("hi")

    asyncio.run(closed())


@pytest.mark.parametrize(("timeout", "deadline"), [(None, None), (float("inf"), None),
                                                    (1e10, None), (2, 2.0),
                                                    (np.int64(3), 3.0)])  # fmt: skip
def test_an_infinite_timeout_is_none(timeout, deadline):
    # gRPC took inf (or any deadline past its clock's range) as already past:
    # DeadlineExceeded at once, where the caller meant "no deadline".
    assert _convert.deadline(timeout) == deadline


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "10"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(timeout):
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0 or None"):
        TandemClient("127.0.0.1:1", timeout=timeout)


def test_a_router_that_froze_mid_stream_fails_the_call(tmp_path):
    # A frozen router (or one whose host went away) sends no reset: with no deadline,
    # generate waited for ever. The client's keepalive pings now end the call.
    server = subprocess.Popen([sys.executable, "-m", "tests.client.fake_router"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        address = server.stdout.readline().strip()
        with TandemClient(address, keepalive_s=1.0) as client:
            stream = client.generate("hi", timeout=60)  # a failing test must not hang
            assert next(stream).text == "Hel"
            os.kill(server.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(Unavailable):
                next(stream)
            assert time.monotonic() - start < 30
    finally:
        server.kill()
        server.wait()


def test_leaving_an_async_stream_early_cancels_it_at_once(fake):
    # The call was cancelled by the async generator's clean-up, a task the event loop
    # ran later: a retry under the same request_id sent meanwhile found it in flight.
    fake.servicer.hang = True

    async def scenario():
        async with AsyncTandemClient(fake.address, timeout=10) as client:
            async for _ in client.generate("hi"):
                break
            # No await since: the event loop has run nothing else.
            assert fake.servicer.cancelled.wait(10)

    asyncio.run(scenario())


def test_a_stream_kept_in_a_variable_is_cancelled_by_leaving_its_with_block(fake):
    # "stream = client.generate(...); for c in stream: break" cannot cancel (the
    # stream is still held, and its tokens may be wanted): the request decoded on to
    # max_tokens, holding its KV, a max_queue place and its key's stream slot. Such a
    # stream is now closed by a with block, sync or async.
    fake.servicer.hang = True
    with TandemClient(fake.address, timeout=10) as client:
        with client.generate("hi") as stream:
            for _ in stream:
                break
            assert not fake.servicer.cancelled.is_set()
        assert fake.servicer.cancelled.wait(10)
        with pytest.raises(StopIteration):  # closed
            next(stream)
    fake.servicer.cancelled.clear()

    async def scenario():
        async with AsyncTandemClient(fake.address, timeout=10) as client:
            async with client.generate("hi") as stream:
                async for _ in stream:
                    break
                assert not fake.servicer.cancelled.is_set()
            assert fake.servicer.cancelled.wait(10)

    asyncio.run(scenario())


def test_a_stream_closed_mid_loop_ends_as_a_closed_generator_does(fake):
    # "for c in stream: ...; stream.close()" ended the loop when generate returned a
    # generator; the stream class raised Cancelled at the next read.
    fake.servicer.hang = True
    with TandemClient(fake.address, timeout=10) as client:
        stream, got = client.generate("hi"), []
        for chunk in stream:
            got.append(chunk.text)
            stream.close()
        assert got == ["Hel"] and fake.servicer.cancelled.wait(10)
        with pytest.raises(StopIteration):
            next(stream)

    async def scenario():
        async with AsyncTandemClient(fake.address, timeout=10) as client:
            stream, got = client.generate("hi"), []
            async for chunk in stream:
                got.append(chunk.text)
                await stream.aclose()
            assert got == ["Hel"]
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()

    asyncio.run(scenario())


def test_a_stream_sends_nothing_until_it_is_read_nor_once_closed_first(fake):
    with TandemClient(fake.address, timeout=10) as client:
        stream = client.generate("hi")
        assert fake.servicer.requests == []
        stream.close()
        assert list(stream) == [] and fake.servicer.requests == []
        assert [c.text for c in client.generate("hi")] == ["Hel", "lo"]

    async def scenario():
        async with AsyncTandemClient(fake.address, timeout=10) as client:
            async with client.generate("hi") as stream:
                pass
            assert [c async for c in stream] == [] and len(fake.servicer.requests) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("call", ["generate", "tokenize"])
def test_closing_an_async_client_under_a_call_raises_cancelled_in_the_callers_task(fake, call):
    # gRPC ends the calls of a closed channel with asyncio's CancelledError: the
    # caller's task ended as if it had been cancelled, past "except TandemClientError",
    # and a TaskGroup around it took itself for cancelled.
    fake.servicer.hang = True

    async def scenario():
        client = AsyncTandemClient(fake.address, timeout=10)

        async def use():
            if call == "generate":
                async for _ in client.generate("hi"):
                    pass
            else:
                fake.servicer.hang_unary = True
                await client.tokenize("hi")

        task = asyncio.create_task(use())
        await asyncio.sleep(0.5)
        await client.close()
        with pytest.raises(Cancelled, match="the client was closed"):
            await task
        assert not task.cancelled()
        # A task that is cancelled itself still ends cancelled.
        client = AsyncTandemClient(fake.address, timeout=10)
        task = asyncio.create_task(client.complete("hi"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()

    asyncio.run(scenario())
