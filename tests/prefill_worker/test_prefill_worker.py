"""PrefillWorker: bad input, transfer failures and cancellation never leak blocks."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.config import DecodeConfig, PrefillConfig
from tandem.engine.sampling_params import SamplingParams
from tests.workers import (
    TIMEOUT,
    engine_config,
    prefill,
    request,
    start_worker,
    stop_worker,
    wait_until,
)

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _dest(rid="r1", blocks=(0, 1, 2), address="127.0.0.1:1"):
    return worker_pb2.KvDestination(
        address=address, request_id=rid, block_ids=blocks, lease_seconds=5
    )


@pytest.mark.parametrize(
    ("req", "dest", "message"),
    [
        (request([5] * 20, PARAMS), _dest(address=""), "destination.address must be HOST:PORT"),
        (request([5] * 20, PARAMS), _dest(rid="other"), "destination.request_id must equal"),
        (
            request([5] * 40, PARAMS),
            _dest(blocks=(0, 1)),
            "destination.block_ids must hold the 3 blocks of the prompt and output_token_ids, "
            "got 2",
        ),
        (  # 30 + 4 tokens of KV to ship: 3 blocks of 16
            request([5] * 30, PARAMS, output_ids=[6] * 4),
            _dest(blocks=(0, 1)),
            "must hold the 3 blocks of the prompt and output_token_ids, got 2",
        ),
        (
            request([5] * 20, PARAMS, output_ids=[6] * 8),
            _dest(),
            "output_token_ids must be fewer than max_tokens (8), got 8",
        ),
        (request([], PARAMS), _dest(), "prompt must not be empty"),
        (request([5, 300], PARAMS), _dest(), "token id 300 is outside [0, 259)"),
        (
            worker_pb2.WorkerRequest(
                request_id="r1",
                prompt_token_ids=[5],
                sampling=tandem_pb2.SamplingParams(repetition_penalty=0.0),
            ),
            _dest(),
            "repetition_penalty must be finite and > 0",
        ),
    ],
)
def test_bad_input_is_invalid_argument_and_takes_nothing(pair, req, dest, message):
    with pytest.raises(grpc.RpcError) as err:
        prefill(pair.prefill, req, dest)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert pair.prefill.used_blocks() == 0 and pair.decode.used_blocks() == 0


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1:0", "127.0.0.1:65536", ":80", "h:x"])
def test_a_destination_that_is_not_host_and_port_is_refused(pair, address):
    with pytest.raises(grpc.RpcError) as err:
        prefill(pair.prefill, request([5] * 20, PARAMS), _dest(address=address))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "destination.address must be HOST:PORT with a port in [1, 65535]" in err.value.details()


def test_calls_beyond_max_queue_are_resource_exhausted_at_once(bg):
    config = PrefillConfig(engine=engine_config(), max_queue=1, kv_connect_timeout_s=1)
    worker = start_worker(bg, config)
    engine = worker.server.engine
    real_step, in_step = engine.step, threading.Event()

    def slow_step():  # holds the first call in the worker
        in_step.set()
        time.sleep(1.0)
        return real_step()

    engine.step = slow_step
    try:
        first = worker.stub.Prefill(  # a streaming call starts here, not when read
            worker_pb2.PrefillRequest(request=request([5] * 20, PARAMS), destination=_dest()),
            timeout=TIMEOUT,
        )
        assert in_step.wait(TIMEOUT)
        with pytest.raises(grpc.RpcError) as err:
            prefill(worker, request([5] * 20, PARAMS, rid="r2"), _dest(rid="r2"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit (max_queue=1)" in err.value.details()
        with pytest.raises(grpc.RpcError):  # the first goes on: its destination is dead
            list(first)
        wait_until(lambda: worker.used_blocks() == 0, what="blocks freed")
    finally:
        engine.step = real_step
        stop_worker(bg, worker)


def test_unreachable_decode_worker_is_aborted_and_frees_blocks(pair):
    with pytest.raises(grpc.RpcError) as err:
        prefill(pair.prefill, request([5] * 40, PARAMS), _dest(address="127.0.0.1:9"))
    assert err.value.code() == grpc.StatusCode.ABORTED  # the decode side failed, not us
    assert "unreachable" in err.value.details()
    # Status is a snapshot the engine thread publishes between steps: it may lag.
    wait_until(lambda: pair.prefill.used_blocks() == 0, what="prefill blocks freed")


def test_reservation_gone_before_the_kv_arrives_is_aborted(pair):
    req = request([5] * 40, PARAMS)
    failures = dict(pair.prefill.server.sender.metrics.failures)
    stream = pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
    dest = next(stream).destination
    stream.cancel()  # the router gave up: the decode side forgets the request
    wait_until(lambda: pair.decode.used_blocks() == 0, what="decode blocks freed")
    with pytest.raises(grpc.RpcError) as err:
        prefill(pair.prefill, req, dest)
    assert err.value.code() == grpc.StatusCode.ABORTED  # the decode side failed, not us
    assert "aborted" in err.value.details()
    # The reason, for the router: not the link's fault, so no cooldown for the pair.
    assert ("tandem-kv-failure", "aborted") in tuple(err.value.trailing_metadata())
    wait_until(lambda: pair.prefill.used_blocks() == 0, what="prefill blocks freed")
    # The decode side gave it up: no transfer failure at either end (it was one here).
    assert pair.prefill.server.sender.metrics.failures == failures


@pytest.mark.parametrize("prompt", [10, 20], ids=["one-block-either-side", "two-blocks-here"])
def test_mismatched_decode_worker_is_named_at_once(bg, pair, prompt):
    # With more blocks here than there, the destination's blocks were counted in this
    # worker's size and refused INVALID_ARGUMENT, blaming the client's request.
    other = start_worker(bg, DecodeConfig(engine=engine_config(block_size=32, num_blocks=8)))
    try:
        req = request([5] * prompt, PARAMS)
        stream = other.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
        dest = next(stream).destination
        with pytest.raises(grpc.RpcError) as err:
            prefill(pair.prefill, req, dest)
        assert err.value.code() == grpc.StatusCode.ABORTED  # the decode side failed, not us
        assert "block_size: prefill 16, decode 32" in err.value.details()
        # The reason, for the router: the pair cannot work, so it is put in cooldown.
        assert ("tandem-kv-failure", "handshake") in tuple(err.value.trailing_metadata())
        wait_until(lambda: pair.prefill.used_blocks() == 0, what="prefill blocks freed")
        stream.cancel()
        other.check_clean()
    finally:
        stop_worker(bg, other)


def test_status_and_health(pair):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = pair.prefill.status()
    assert status.role == worker_pb2.ROLE_PREFILL and status.worker_id.startswith("prefill-")
    assert (status.queue_depth, status.running, status.kv_blocks_used) == (0, 0, 0)
    assert status.kv_blocks_free == status.kv_blocks_total == 64 and status.kv_address == ""
    health = health_pb2_grpc.HealthStub(pair.prefill.channel)
    reply = health.Check(
        health_pb2.HealthCheckRequest(service="tandem.v1.PrefillWorker"), timeout=TIMEOUT
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_prefill_deadline_frees_blocks_on_both_sides(pair, monkeypatch):
    engine = pair.prefill.server.engine
    real_step = engine.step

    def slow_step():  # past the deadline on any machine
        time.sleep(0.5)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    req = request([5] * 600, PARAMS)
    stream = pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
    dest = next(stream).destination
    with pytest.raises(grpc.RpcError) as err:
        prefill(pair.prefill, req, dest, timeout=0.1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: pair.prefill.used_blocks() == 0, what="prefill blocks freed")
    stream.cancel()
    wait_until(lambda: pair.decode.used_blocks() == 0, what="decode blocks freed")


def test_the_kv_goes_out_right_after_the_step_not_behind_the_next_one(bg, pair):
    """A prompt's last KV message and first token leave as soon as its step ends, even
    when the engine goes straight on to a long step for the next prompt: its decode
    worker starts decoding at once."""
    worker = start_worker(bg, PrefillConfig(engine=engine_config(max_num_seqs=1)))
    runner = worker.server.engine.runner
    real, slow_step_ended, fast_stepped = runner.run, [], threading.Event()

    def run(work, after_layer=None):
        if any(seq.request_id == "fast" for seq, _ in work):
            fast_stepped.set()
        out = real(work, after_layer)
        if any(seq.request_id == "slow" for seq, _ in work):
            time.sleep(3.0)  # a long prefill step
            slow_step_ended.append(time.monotonic())
        return out

    runner.run = run
    # The worker's event loop hears of the first token late (a busy loop): by then the
    # slow step is under way, and nothing the handler asks of the engine thread can
    # run before it ends.
    loop = worker.server.loop
    deliver = loop._deliver
    loop._deliver = lambda out: threading.Timer(0.3, deliver, (out,)).start()
    try:
        decoding: dict[str, float] = {}  # when the decode worker streamed its first chunk

        def one(rid: str, prompt: list[int]) -> None:
            req = request(prompt, PARAMS, rid=rid)
            stream = pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=30)
            dest = next(stream).destination
            call = threading.Thread(target=prefill, args=(worker, req, dest))
            call.start()
            assert next(stream).chunk.token_ids  # comes once the KV is there
            decoding[rid] = time.monotonic()
            for _ in stream:
                pass
            call.join(30)

        # One sequence at a time: "fast" runs in the first step, "slow" in the next.
        threads = [threading.Thread(target=one, args=a) for a in (("fast", [5] * 20),
                                                                   ("slow", [6] * 20))]  # fmt: skip
        threads[0].start()
        assert fast_stepped.wait(30), "the first request never reached the engine"
        threads[1].start()
        for t in threads:
            t.join(60)
        assert set(decoding) == {"fast", "slow"} and slow_step_ended
        assert decoding["fast"] < slow_step_ended[0]  # not held back by the slow step
    finally:
        runner.run, loop._deliver = real, deliver
        stop_worker(bg, worker)


def _hold_the_kv(decode_w) -> threading.Event:
    """The decode worker's receiver takes in no KV until the returned event is set."""
    receiver = decode_w.server.receiver.core
    deliver, release = receiver.deliver, threading.Event()

    def held(*args, **kwargs):
        assert release.wait(TIMEOUT)
        return deliver(*args, **kwargs)

    receiver.deliver = held
    return release


def test_blocks_stay_held_until_the_decode_side_has_read_them(bg):
    """The decode worker reads the prompt's blocks out of the prefill worker's cache:
    they stay held until its ack, and go back once the call ends."""
    prefill_w = start_worker(bg, PrefillConfig(engine=engine_config()))
    decode_w = start_worker(bg, DecodeConfig(engine=engine_config()))
    release = _hold_the_kv(decode_w)  # the decode side takes its time with the KV
    try:
        req = request([5] * 40, PARAMS)  # 3 blocks
        stream = decode_w.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
        dest = next(stream).destination
        call = threading.Thread(target=prefill, args=(prefill_w, req, dest))
        call.start()
        wait_until(lambda: prefill_w.server.service._transfers, what="the KV on its way")
        time.sleep(0.3)
        assert prefill_w.used_blocks() == 3
        release.set()
        call.join(TIMEOUT)
        assert len(list(stream)) >= 1  # decoded from the blocks it read
        wait_until(lambda: prefill_w.used_blocks() == 0, what="prefill blocks freed")
    finally:
        release.set()
        stop_worker(bg, prefill_w)
        stop_worker(bg, decode_w)


def test_an_ack_that_never_comes_is_a_counted_transfer_failure(bg):
    # The call ends ABORTED, and the sender's abort then was its owner's give-up: the
    # failure was counted nowhere (nor warned of), on either side.
    prefill_w = start_worker(bg, PrefillConfig(engine=engine_config(), kv_ack_timeout_s=0.5))
    decode_w = start_worker(bg, DecodeConfig(engine=engine_config()))
    release = _hold_the_kv(decode_w)  # the decode side never gets to ack in time
    try:
        req = request([5] * 40, PARAMS)
        stream = decode_w.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
        dest = next(stream).destination
        with pytest.raises(grpc.RpcError) as err:
            prefill(prefill_w, req, dest)
        assert err.value.code() is grpc.StatusCode.ABORTED, err.value.details()
        assert prefill_w.server.sender.metrics.failures == {"timeout": 1}
        stream.cancel()
    finally:
        release.set()
        stop_worker(bg, prefill_w)
        stop_worker(bg, decode_w)
