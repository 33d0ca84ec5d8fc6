"""DecodeWorker on its own: reservations, leases, cancellation, limits, Status and health."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.config import DecodeConfig, PrefillConfig
from tandem.engine.sampling_params import SamplingParams
from tests.workers import (
    TIMEOUT,
    drive,
    engine_config,
    prefill,
    request,
    start_worker,
    stop_worker,
    wait_until,
)

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _open(worker, req, timeout=TIMEOUT):
    stream = worker.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=timeout)
    return stream, next(stream).destination


def test_destination_names_the_reserved_blocks_and_status_counts_them(pair):
    decode = pair.decode
    stream, dest = _open(decode, request([5] * 30, PARAMS))  # 70 tokens: 5 blocks
    assert dest.address == decode.server.kv_address and dest.request_id == "r1"
    assert len(dest.block_ids) == 5 and dest.lease_seconds == 10
    status = decode.status()
    assert (status.kv_blocks_used, status.kv_blocks_free, status.kv_blocks_total) == (5, 59, 64)
    assert status.queue_depth == 1 and status.running == 0  # waiting for its KV
    assert status.role == worker_pb2.ROLE_DECODE and status.kv_address == dest.address
    assert status.worker_id == f"decode-{decode.server.address}"
    stream.cancel()
    wait_until(lambda: decode.used_blocks() == 0, what="blocks freed after cancel")


def test_cancelled_stream_frees_its_blocks_within_a_second(pair):
    stream, _ = _open(pair.decode, request([5] * 30, PARAMS))
    assert pair.decode.used_blocks() == 5
    stream.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after cancel")


def test_cancel_while_decoding_frees_blocks(pair):
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)  # 59 of 64 blocks
    req = request([5] * 30, params)
    stream, dest = _open(pair.decode, req)
    prefill(pair.prefill, req, dest)
    chunk = next(stream).chunk
    assert chunk.token_ids and not chunk.finish_reason
    stream.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after cancel")


def test_deadline_while_waiting_for_kv_frees_blocks(pair):
    # The deadline outlasts opening the stream on a loaded machine, not the 10 s lease.
    stream, _ = _open(pair.decode, request([5] * 30, PARAMS), timeout=3)
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after the deadline")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(temperature=-1.0), "temperature must be finite and >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(min_p=2.0), "min_p must be in [0, 1]"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(max_tokens=5000), "exceeds the context length 4096"),
        (dict(max_tokens=2000), "needs 127 KV blocks, the pool has 64"),
    ],
)
def test_bad_input_is_invalid_argument_and_takes_nothing(pair, change, field):
    sampling = tandem_pb2.SamplingParams(max_tokens=8, temperature=0)
    for key, value in change.items():
        if key == "stop":
            sampling.stop.extend(value)
        else:
            setattr(sampling, key, value)
    req = worker_pb2.WorkerRequest(request_id="bad", prompt_token_ids=[5] * 30, sampling=sampling)
    with pytest.raises(grpc.RpcError) as err:
        list(pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert pair.decode.used_blocks() == 0


@pytest.mark.parametrize(
    ("prompt", "rid", "message"),
    [
        ([], "r", "prompt must not be empty"),
        ([5, 999], "r", "token id 999 is outside [0, 259)"),
        ([5], "", "request_id must not be empty"),
    ],
)
def test_bad_request_fields_are_named(pair, prompt, rid, message):
    req = worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=prompt)
    with pytest.raises(grpc.RpcError) as err:
        list(pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_reservation_that_does_not_fit_now_is_resource_exhausted(pair):
    # 400 prompt tokens + the 128 output tokens reserved up front: 33 of 64 blocks.
    params = SamplingParams(max_tokens=600, temperature=0)
    held, _ = _open(pair.decode, request([5] * 400, params, rid="big"))
    with pytest.raises(grpc.RpcError) as err:
        _open(pair.decode, request([8] * 400, params, rid="big2"))  # nothing of it cached
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 33 more KV blocks, 31 free" in err.value.details()
    held.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after cancel")


def test_duplicate_request_id_is_refused(pair):
    first, _ = _open(pair.decode, request([5] * 10, PARAMS, rid="same"))
    with pytest.raises(grpc.RpcError) as err:
        _open(pair.decode, request([5] * 10, PARAMS, rid="same"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already running" in err.value.details()
    first.cancel()


def test_health_reports_serving(pair):
    for worker, service in ((pair.decode, "tandem.v1.DecodeWorker"), (pair.prefill, "")):
        health = health_pb2_grpc.HealthStub(worker.channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_lease_expiry_without_prefill_is_aborted_and_frees_blocks(bg):
    worker = start_worker(bg, DecodeConfig(engine=engine_config(num_blocks=16), kv_lease_s=0.3))
    try:
        stream, dest = _open(worker, request([5] * 30, PARAMS))
        assert dest.lease_seconds == pytest.approx(0.3)
        with pytest.raises(grpc.RpcError) as err:  # the lease, not the call's deadline, ends it
            next(stream)
        # ABORTED: the worker is alive (the router must not take it for dead); the KV failed.
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "lease expired" in err.value.details()
        worker.check_clean()
    finally:
        stop_worker(bg, worker)


def _serving(health) -> bool:
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    except grpc.RpcError:  # the server already refuses new calls
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_drains_then_cancels_and_frees_everything(bg):
    worker = start_worker(bg, DecodeConfig(engine=engine_config(num_blocks=16)))
    health = health_pb2_grpc.HealthStub(worker.channel)
    stream, _ = _open(worker, request([5] * 30, PARAMS))  # waits for KV that never comes
    stopping = asyncio.run_coroutine_threadsafe(worker.server.stop(grace=0.5), bg.loop)
    wait_until(lambda: not _serving(health), what="NOT_SERVING (or refusing calls) once stopping")
    stopping.result(TIMEOUT)
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    engine = worker.server.engine
    engine.kv.pool.check_integrity()
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    worker.channel.close()


def test_a_stop_during_a_stalled_kv_read_does_not_take_the_engine_for_hung(bg, monkeypatch, caplog):
    # The stop's clean-up waited on the engine thread for each KV read in flight (up to
    # the transport's 30 s read timeout). Past the 10 s the stop gives the engine, the
    # worker logged a hung engine and stopped without it (a tensor-parallel one killed
    # its other ranks).
    from tandem.worker import server as worker_server

    monkeypatch.setattr(worker_server, "_ENGINE_ANSWER_S", 1.0)
    worker = start_worker(bg, DecodeConfig(engine=engine_config(num_blocks=16)))
    _open(worker, request([5] * 30, PARAMS, rid="A"))  # waits for KV
    read = worker.server.receiver.core._table["A"].write_lock  # a read in flight into A
    read.acquire()
    try:
        with caplog.at_level(logging.ERROR, logger="tandem"):
            stopping = asyncio.run_coroutine_threadsafe(worker.server.stop(grace=0.2), bg.loop)
            stopping.result(3.0)
    finally:
        read.release()
    assert "did not answer" not in caplog.text
    engine = worker.server.engine
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    worker.channel.close()


def test_an_open_health_watch_does_not_hold_the_drain(bg):
    # gRPC's graceful stop waited the rest of the grace for a Watch, which never ends.
    worker = start_worker(bg, DecodeConfig(engine=engine_config(num_blocks=16)))
    watch = health_pb2_grpc.HealthStub(worker.channel).Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    start = time.monotonic()
    asyncio.run_coroutine_threadsafe(worker.server.stop(grace=20), bg.loop).result(TIMEOUT)
    assert time.monotonic() - start < 5  # nothing was in flight
    worker.channel.close()


def _here(worker, req, timeout=TIMEOUT):
    """Decode with prefill_here: (the first response's destination, the chunks)."""
    stream = worker.stub.Decode(
        worker_pb2.DecodeRequest(request=req, prefill_here=True), timeout=timeout
    )
    dest = next(stream).destination
    return dest, [r.chunk for r in stream]


def test_prefill_here_streams_every_token_itself_and_counts_it(tiny_engine, pair):
    decode = pair.decode
    before = decode.status()
    prompt = tiny_engine.tokenizer.encode("long prompt " * 30)
    dest, chunks = _here(decode, request(prompt, PARAMS, rid="here"))
    assert dest.address == "" and dest.lease_seconds == 0 and dest.request_id == "here"
    assert len(dest.block_ids) == -(-(len(prompt) + PARAMS.max_tokens) // 16)
    outs = list(tiny_engine.stream(prompt, PARAMS))
    assert [t for c in chunks for t in c.token_ids] == [t for o in outs for t in o.token_ids]
    assert "".join(c.text for c in chunks) == "".join(o.text for o in outs)
    assert chunks[-1].completion_tokens == PARAMS.max_tokens
    after = decode.status()
    assert after.prefilled_here == before.prefilled_here + 1
    assert after.served == before.served + 1
    assert after.kv_transfers_total == before.kv_transfers_total  # nothing was received
    assert after.prefix_query_tokens == before.prefix_query_tokens + len(prompt)
    # What its steps cost, for the router's conditional rule: a prefill is measured
    # against the decode steps timed before it (its first step has none to go by).
    assert after.decode_step_seconds > 0
    other = tiny_engine.tokenizer.encode("another prompt " * 30)  # not cached
    _here(decode, request(other, PARAMS, rid="here-again"))
    assert decode.status().prefill_token_seconds > 0


def test_prefill_here_reuses_what_the_decode_worker_has_cached(tiny_engine, pair):
    decode = pair.decode
    system = tiny_engine.tokenizer.encode("you are a helpful assistant " * 8)
    _here(decode, request(system + [7, 8], PARAMS, rid="a"))
    before = decode.status().prefix_hit_tokens
    _here(decode, request(system + [9, 10], PARAMS, rid="b"))
    assert decode.status().prefix_hit_tokens - before == len(system) // 16 * 16


def test_prefill_here_that_does_not_fit_now_is_resource_exhausted(pair):
    # 400 prompt tokens + the 128 output tokens reserved up front: 33 of 64 blocks.
    params = SamplingParams(max_tokens=600, temperature=0)
    held, _ = _open(pair.decode, request([5] * 400, params, rid="big"))
    with pytest.raises(grpc.RpcError) as err:
        _here(pair.decode, request([6] * 400, params, rid="big2"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 33 more KV blocks, 31 free" in err.value.details()
    held.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after cancel")


def test_prefill_here_cancelled_mid_stream_frees_its_blocks(pair):
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    stream = pair.decode.stub.Decode(
        worker_pb2.DecodeRequest(request=request([5] * 30, params), prefill_here=True),
        timeout=TIMEOUT,
    )
    next(stream)  # the destination
    assert next(stream).chunk.token_ids  # the first token, sampled here
    stream.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="blocks freed after cancel")


def test_an_arrived_transfer_wakes_an_idle_worker_that_would_poll_in_an_hour(pair):
    loop = pair.decode.server.loop
    loop.poll_interval_s = 3600
    try:
        time.sleep(0.3)  # the engine thread is back in an hour-long wait
        req = request([5] * 30, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        stream, dest = _open(pair.decode, req)
        prefill(pair.prefill, req, dest)
        # Admitted when the KV arrived: the receiver woke the engine thread.
        assert next(stream).chunk.token_ids
    finally:
        loop.poll_interval_s = 0.1
        loop.wake()


def test_a_read_still_running_into_a_cancelled_request_s_blocks_stalls_no_stream(pair):
    # A KV read from a slow or stalled peer (up to the transport's read timeout) holds
    # the reservation's write lock; the cancel's clean-up must not wait for it on the
    # engine thread, where every request of the worker would wait with it.
    import threading

    decode = pair.decode
    stream, _ = _open(decode, request([5] * 30, PARAMS, rid="A"))
    read = decode.server.receiver.core._table["A"].write_lock  # a read in flight into A
    read.acquire()
    try:
        stream.cancel()
        # The engine thread handled the cancel and published its numbers again.
        wait_until(lambda: decode.status().queue_depth == 0, timeout=10, what="cancel handled")
        assert decode.used_blocks() == 5  # A's blocks are still the read's
        served: list = []
        other = threading.Thread(
            target=lambda: served.append(drive(pair, request([9] * 20, PARAMS, rid="B"))),
            daemon=True,
        )
        other.start()
        other.join(20)
        assert served and len(served[0].tokens) == PARAMS.max_tokens  # the engine went on
    finally:
        read.release()
    wait_until(lambda: decode.used_blocks() == 0, what="A's blocks back once the read ended")


@pytest.mark.parametrize("prefill_here", [False, True])
def test_the_id_of_a_request_whose_blocks_wait_for_a_read_is_taken_not_freed(pair, prefill_here):
    # A client's retry under the same id, while the first try's blocks still wait for
    # a read into them: not the other request's blocks freed, not a request refused as
    # invalid, nor one queued for room (ahead of every other), but "retry later".
    decode = pair.decode
    req = request([5] * 30, PARAMS, rid="A")
    stream, _ = _open(decode, req)
    read = decode.server.receiver.core._table["A"].write_lock  # a read in flight into A
    read.acquire()
    try:
        stream.cancel()
        wait_until(lambda: decode.status().queue_depth == 0, timeout=10, what="cancel handled")
        again = decode.stub.Decode(
            worker_pb2.DecodeRequest(request=req, prefill_here=prefill_here), timeout=TIMEOUT
        )
        with pytest.raises(grpc.RpcError) as info:
            next(again)
        assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS
        assert "still being released); retry later" in info.value.details()
        time.sleep(0.2)  # the refused handler's clean-up has run
        assert decode.used_blocks() == 5  # still the read's
    finally:
        read.release()
    wait_until(lambda: decode.used_blocks() == 0, what="A's blocks back once the read ended")
    assert [c.token_ids for c in drive(pair, req).chunks]  # and the id serves again


def test_a_prefill_here_cancelled_before_its_handler_heard_back_is_aborted():
    # The engine ran prefill_here, but the handler was cancelled before it heard back
    # (the engine thread was still in its hooks): the request must not decode on with
    # nobody reading, holding its blocks.
    import threading
    from types import SimpleNamespace

    from tandem.decode_worker.service import DecodeService
    from tandem.engine.loop import EngineLoop
    from tandem.worker.request import WorkRequest
    from tests.conftest import make_engine

    engine = make_engine()
    loop = EngineLoop(engine)
    in_hook = threading.Event()
    loop.add_hook(lambda e: (in_hook.set(), time.sleep(0.3)) if e.has_unfinished() else None)
    loop.start()
    try:
        server = SimpleNamespace(loop=loop, engine=engine, worker_id="d", prefilled_here=0)
        req = WorkRequest("R", [5] * 20, SamplingParams(max_tokens=500, temperature=0), [])

        async def main():
            handler = DecodeService(server)._prefill_here(req, context=None)
            first = asyncio.ensure_future(anext(handler))
            await asyncio.to_thread(in_hook.wait, 10)  # prefill_here has run
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await handler.aclose()

        asyncio.run(main())
        wait_until(lambda: loop.submit(lambda e: e.kv.pool.num_used).result(5) == 0,
                   what="its blocks back")  # fmt: skip
        assert not loop.submit(lambda e: e.has_unfinished()).result(5)
    finally:
        loop.stop()


def test_a_request_id_reused_while_a_step_still_holds_the_old_one_gets_its_own_tokens(
    tiny_engine, pair, monkeypatch
):
    # A client cancels (or times out) and at once sends another request under the same
    # id, while a step that holds the old request runs: its outputs used to land in the
    # new stream (a token of the other prompt, one too many), as a success.
    decode = pair.decode
    engine = decode.server.engine
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    old, new = list(range(10, 40)), list(range(100, 117))
    expected = [t for c in _here(decode, request(new, short, rid="ref"))[1] for t in c.token_ids]
    step, slow = engine.step, []

    def slow_step():
        outputs = step()
        if slow:
            time.sleep(0.4)
        return outputs

    monkeypatch.setattr(engine, "step", slow_step)
    slow.append(True)
    first = decode.stub.Decode(
        worker_pb2.DecodeRequest(request=request(old, PARAMS, rid="X"), prefill_here=True),
        timeout=TIMEOUT,
    )
    next(first), next(first)  # the destination, the first token: X is running
    time.sleep(0.1)  # inside a step that holds X
    first.cancel()
    time.sleep(0.05)
    _, chunks = _here(decode, request(new, short, rid="X"))
    slow.clear()
    assert [t for c in chunks for t in c.token_ids] == expected
    wait_until(lambda: engine.kv.pool.num_used == 0, what="blocks back")


def test_a_draining_decode_worker_keeps_renewing_leases_and_finishes_its_streams(bg):
    # A reservation whose prefill is still queued elsewhere when the worker is told to
    # stop: the router renews its lease during the drain, and gRPC's graceful stop
    # refused those calls, so the stream ended "lease expired" although it had time.
    prefill_worker = start_worker(bg, PrefillConfig(engine=engine_config(), kv_backend="inproc"))
    decode = start_worker(bg, DecodeConfig(engine=engine_config(), kv_backend="inproc",
                                           kv_lease_s=1.0))  # fmt: skip
    try:
        req = request(list(range(5, 30)), SamplingParams(max_tokens=4, temperature=0), rid="D")
        stream = decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
        dest = next(stream).destination
        stopping = asyncio.run_coroutine_threadsafe(decode.server.stop(grace=8.0), bg.loop)
        for _ in range(4):  # 2 s: twice the lease
            time.sleep(0.5)
            renewed = decode.stub.RenewLease(worker_pb2.RenewLeaseRequest(request_id="D"))
            assert renewed.renewed
        # Status fails, so that a router marks it down once and leaves it down (one that
        # answered was taken back at each poll and sent new calls, refused in turn).
        with pytest.raises(grpc.RpcError) as status:
            decode.stub.Status(worker_pb2.StatusRequest())
        assert status.value.code() is grpc.StatusCode.UNAVAILABLE
        # A second stop (a restarted Ray controller asks again) waits for the first.
        again = asyncio.run_coroutine_threadsafe(decode.server.stop(grace=1.0), bg.loop)
        with pytest.raises(grpc.RpcError) as refused:  # new work goes elsewhere
            next(decode.stub.Decode(worker_pb2.DecodeRequest(request=request(
                [7, 8, 9], PARAMS, rid="late")), timeout=TIMEOUT))  # fmt: skip
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        prefill(prefill_worker, req, dest)
        assert sum(len(r.chunk.token_ids) for r in stream) == 3  # the rest after the first
        stopping.result(30)
        again.result(30)
    finally:
        decode.channel.close()
        stop_worker(bg, prefill_worker)
