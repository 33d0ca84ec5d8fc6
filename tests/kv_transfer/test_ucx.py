"""The UCX backend between real processes (spawned helpers from ucx_peer.py). Every
test runs over both read paths of the decode side: "mapped" (the prefill worker's
cache mapped into the receiver, blocks copied out of it) and "get" (UCX one-sided
reads, the path across hosts and GPUs)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from tandem.kv_transfer import (
    Destination,
    HandshakeError,
    TransferError,
    TransferState,
    make_receiver,
    make_sender,
)
from tests.kv_transfer.conftest import fingerprint, make_side
from tests.kv_transfer.ucx_peer import PeerProcess

pytest.importorskip("ucxx")

SEED = 21


@pytest.fixture(scope="module", params=["mapped", "get"])
def path(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def remote_receiver(path):
    peer = PeerProcess("receiver", num_blocks=256, map_peers=path == "mapped")
    yield peer
    peer.stop()


@pytest.fixture
def receiver(remote_receiver):
    """The shared receiver process; after each test its pool must be clean."""
    yield remote_receiver
    assert remote_receiver("live") == 0
    remote_receiver("check_clean")


@pytest.fixture
def prefill():
    """This process's KV (random, reproducible, in UCX memory as a prefill worker's is)
    and a sender over it."""
    side = make_side(128, seed=SEED, ucx=True)
    sender = make_sender("ucx", side.kv, fingerprint(), ack_timeout_s=10)
    yield side, sender
    sender.close()
    side.check_clean()


def _wait_state(peer, rid: str, states, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        status = peer("poll", rid)
        if status.state in states or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def test_blocks_arrive_bit_identical_at_other_ids(receiver, prefill, path) -> None:
    side, sender = prefill
    side.pool.allocate(7)
    src_ids = side.pool.allocate(6)[::-1]
    dst_ids = receiver("allocate", 8)
    dst_ids = dst_ids[3:] + dst_ids[:3]
    dest = receiver("expect", "r1", dst_ids, 30.0)
    sender.send_layers(dest, src_ids, (1, 3))
    status = sender.send(dest, src_ids, first_token=99).result(timeout=20)

    assert status.state is TransferState.DONE
    got = receiver("poll", "r1")
    assert (got.state, got.first_token) == (TransferState.DONE, 99)
    assert torch.equal(receiver("blocks", dst_ids[:6]), side.kv[:, :, src_ids])
    assert not receiver("blocks", dst_ids[6:]).any()
    assert receiver("metrics").bytes_received == sender.metrics.bytes_sent == status.bytes
    assert receiver("mapped") == [path == "mapped"]
    receiver("release", "r1")
    receiver("free", dst_ids)
    side.pool.free(list(range(7)) + src_ids)


def test_the_blocks_are_read_in_place(receiver, prefill) -> None:
    side, sender = prefill
    seen = []
    sender.fault_hook = lambda header, blocks: seen.append(blocks.data_ptr())
    src_ids, dst_ids = side.pool.allocate(4), receiver("allocate", 4)
    dest = receiver("expect", "inplace", dst_ids, 30.0)
    assert sender.send(dest, src_ids, first_token=1).result(timeout=20).state is (
        TransferState.DONE
    )
    assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
    # The hook saw the cache's own block: that is what the receiver read.
    assert seen == [side.kv[0, 0, src_ids[0]].data_ptr()]
    receiver("release", "inplace")
    receiver("free", dst_ids)
    side.pool.free(src_ids)


def test_control_goes_through_a_mailbox_on_one_host(receiver, prefill, path) -> None:
    """A receiver that maps its peers (one host) takes the sender's mailbox: frames and
    acks skip UCX. One that reads with UCX gets (the path across hosts) keeps them on
    UCX, and its transfers work as well."""
    from tandem.kv_transfer.ucx import mailbox

    side, sender = prefill
    src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 2)
    dest = receiver("expect", "mb", dst_ids, 30.0)
    assert sender.send(dest, src_ids, first_token=1).result(timeout=20).state is (
        TransferState.DONE
    )
    assert set(receiver("mailbox")) == {path == "mapped" and mailbox.supported()}
    receiver("release", "mb")
    receiver("free", dst_ids)
    side.pool.free(src_ids)


@pytest.mark.parametrize(
    "junk", [b"Z not a frame", b"K" + b"[" * 20_000], ids=["unknown-kind", "json-too-deep"]
)
def test_a_bad_frame_in_the_mailbox_ends_the_connection_and_the_next_request_reconnects(
    receiver, prefill, path, junk
) -> None:
    """A record the receiver cannot take ends that connection at both ends (the sender
    hears of it through the closed rings), whatever it raises there (a header nested
    too deep for the JSON parser is a RecursionError, not a protocol error), and the
    next request connects again; the old connection's mailbox is freed."""
    from tandem.kv_transfer.ucx import mailbox

    if path != "mapped" or not mailbox.supported():
        pytest.skip("a mailbox is taken only where the sender's memory can be mapped")
    side, sender = prefill
    src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 2)
    first = receiver("expect", "before", dst_ids, 30.0)
    assert sender.send(first, src_ids, first_token=1).result(timeout=20).state is (
        TransferState.DONE
    )
    receiver("release", "before")
    peer = sender._peers[first.address]

    with sender._route:  # held by whoever puts into a frame ring
        assert peer.mailbox.frames.put(junk)
    deadline = time.monotonic() + 20
    while not peer.dead:
        assert time.monotonic() < deadline, "the sender never heard that the connection ended"
        time.sleep(0.01)
    after = receiver("expect", "after", dst_ids, 30.0)
    assert sender.send(after, src_ids, first_token=3).result(timeout=20).state is (
        TransferState.DONE
    )
    assert sender._peers[first.address] is not peer
    assert sender._direct[first.address] is sender._peers[first.address]  # direct again
    while sender._queued:  # uncounted by the loop after the put, which the ack can overtake
        assert time.monotonic() < deadline, sender._queued
        time.sleep(0.01)
    while peer.mailbox_users:  # the loop frees it once the ack thread has let go
        assert time.monotonic() < deadline, "the old connection's mailbox was never freed"
        time.sleep(0.01)
    assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
    receiver("release", "after")
    receiver("free", dst_ids)
    side.pool.free(src_ids)


def test_frames_handed_to_the_loop_stay_counted_across_a_lost_connection(
    receiver, prefill, path
) -> None:
    """A caller puts a header into the mailbox itself only while no frame handed to the
    loop for that peer is unwritten. A header counted while its connection was being
    lost goes to the next connection's queue: the count must still hold it, or later
    headers would overtake it there."""
    from tandem.kv_transfer.ucx import mailbox

    if path != "mapped" or not mailbox.supported():
        pytest.skip("a mailbox is taken only where the sender's memory can be mapped")
    side, sender = prefill
    rt = sender._rt
    src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 4)
    first = receiver("expect", "first", dst_ids[:2], 30.0)
    assert sender.send(first, src_ids, first_token=1).result(timeout=20).state is (
        TransferState.DONE
    )
    receiver("release", "first")
    address, old = first.address, sender._peers[first.address]
    old.mailbox.frames.close()  # as the receiver closing its side: the next put fails
    rt.call_soon(time.sleep, 0.5)  # the loop is busy while the caller sends
    rt.call_soon(sender._lost, old, TransferError("peer lost", "test"))
    late = receiver("expect", "late", dst_ids[:2], 30.0)
    sender.send_layers(late, src_ids, (0, 1))  # counted, handed to the loop
    rt.call_soon(time.sleep, 0.5)  # the next connection is not up yet
    time.sleep(0.6)
    after = receiver("expect", "after", dst_ids[2:], 30.0)
    sender.send_layers(after, src_ids, (0, 1))

    async def counts() -> tuple[int, int]:
        return sender._queued.get(address, 0), sender._peers[address].queue.qsize()

    queued, in_queue = rt.submit(counts()).result(timeout=10)
    assert queued == in_queue == 2
    for rid in ("late", "after"):
        sender.abort(rid)
        receiver("release", rid)
    receiver("free", dst_ids)
    side.pool.free(src_ids)


def test_a_cache_torch_allocated_is_read_with_gets(receiver) -> None:
    """Memory UCX did not allocate cannot be mapped by a peer: the receiver reads it
    with UCX gets, whatever it would prefer."""
    side = make_side(8, seed=SEED)
    sender = make_sender("ucx", side.kv, fingerprint())
    src_ids, dst_ids = side.pool.allocate(3), receiver("allocate", 3)
    dest = receiver("expect", "plain", dst_ids, 30.0)
    assert sender.send(dest, src_ids, first_token=1).result(timeout=20).state is (
        TransferState.DONE
    )
    assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
    # This sender's connection is the one not mapped (the cleanup of an earlier test's
    # closed connection may still be under way, and its cache was mapped).
    assert False in receiver("mapped")
    sender.close()
    receiver("release", "plain")
    receiver("free", dst_ids)
    side.pool.free(src_ids)


def test_handshake_mismatch_is_named_at_once(receiver) -> None:
    side = make_side(8, seed=SEED)
    sender = make_sender(
        "ucx", side.kv, fingerprint(block_size=32, dtype="bfloat16"), connect_timeout_s=120
    )
    address = receiver("address")
    start = time.monotonic()
    with pytest.raises(HandshakeError) as err:
        sender.connect(address)
    assert time.monotonic() - start < 60  # named, not waited out (connect_timeout_s)
    assert "block_size: prefill 32, decode 16" in str(err.value)
    assert "dtype: prefill bfloat16, decode float32 (set engine.dtype where the" in str(err.value)
    # A send through the refused connection fails the same way, not by timing out.
    dst_ids = receiver("allocate", 1)
    dest = receiver("expect", "hs", dst_ids, 30.0)
    with pytest.raises(HandshakeError, match="block_size"):
        sender.send(dest, [0], first_token=1).result(timeout=5)
    assert receiver("poll", "hs").state is TransferState.WAITING
    sender.close()
    receiver("release", "hs")
    receiver("free", dst_ids)


def test_32_concurrent_requests_share_one_connection(receiver, prefill) -> None:
    side, sender = prefill
    jobs = []
    for i in range(32):
        src_ids, dst_ids = side.pool.allocate(3), receiver("allocate", 3)[::-1]
        jobs.append((f"c{i}", src_ids, dst_ids, receiver("expect", f"c{i}", dst_ids, 30.0)))
    futures = []
    for _, src_ids, _, dest in jobs:
        sender.send_layers(dest, src_ids, (0, 2))
    for rid, src_ids, _, dest in jobs:
        futures.append(sender.send(dest, src_ids, first_token=int(rid[1:])))
    for fut in futures:
        assert fut.result(timeout=30).state is TransferState.DONE
    assert len(sender._peers) == 1  # one connection for all 32
    for rid, src_ids, dst_ids, _ in jobs:
        assert receiver("poll", rid).first_token == int(rid[1:])
        assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
        receiver("release", rid)
        receiver("free", dst_ids)
        side.pool.free(src_ids)


def test_corrupted_payload_fails_across_processes(receiver) -> None:
    side = make_side(16, seed=SEED, ucx=True)

    def corrupt(header, block) -> None:
        block.view(torch.int32).view(-1)[0] ^= 1  # the source block, after its checksum

    sender = make_sender("ucx", side.kv, fingerprint(), fault_hook=corrupt)
    src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 2)
    dest = receiver("expect", "bad", dst_ids, 30.0)
    with pytest.raises(TransferError) as err:
        sender.send(dest, src_ids, first_token=1).result(timeout=20)
    assert err.value.reason == "checksum"
    status = receiver("poll", "bad")
    assert (status.state, status.reason) == (TransferState.FAILED, "checksum")
    sender.close()
    receiver("release", "bad")
    receiver("free", dst_ids)
    side.pool.free(src_ids)
    side.check_clean()


def test_killing_the_receiver_fails_the_sender_within_the_timeout(prefill, path) -> None:
    side, sender = prefill
    peer = PeerProcess("receiver", read_delay_s=30.0, map_peers=path == "mapped")
    try:
        src_ids, dst_ids = side.pool.allocate(4), peer("allocate", 4)
        dest = peer("expect", "k", dst_ids, 60.0)
        sender.send_layers(dest, src_ids, (0, 2))
        fut = sender.send(dest, src_ids, first_token=1)
        assert _wait_state(peer, "k", {TransferState.TRANSFERRING}).state is (
            TransferState.TRANSFERRING
        )
        peer.kill()
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            fut.result(timeout=120)  # a ceiling against a hang
        assert err.value.reason in ("peer lost", "timeout")
        # The sender's ack_timeout_s (10 s here, 30 s by default) bounds the worst case;
        # 25 s tells the configured bound from the default with room for a loaded machine.
        assert time.monotonic() - start < 25
        side.pool.free(src_ids)  # the caller takes its blocks back
    finally:
        peer.stop()


def test_killing_the_sender_fails_the_receiver(fp, path) -> None:
    side = make_side(32)
    receiver = make_receiver("ucx", side.kv, fp, map_peers=path == "mapped")
    peer = PeerProcess("sender", seed=SEED)
    try:
        dst_ids = side.pool.allocate(3)
        dest = receiver.expect("ks", dst_ids, lease_s=60)
        src_ids = peer("allocate", 3)
        peer("send_layers", dest, src_ids, (0, 2))
        deadline = time.monotonic() + 60
        while receiver.poll("ks").state is TransferState.WAITING and time.monotonic() < deadline:
            time.sleep(0.01)
        peer.kill()
        deadline = time.monotonic() + 60
        while receiver.poll("ks").state is TransferState.TRANSFERRING:
            assert time.monotonic() < deadline, "peer loss not noticed"
            time.sleep(0.02)
        status = receiver.poll("ks")
        assert (status.state, status.reason) == (TransferState.FAILED, "peer lost")
        receiver.release("ks")
        side.pool.free(dst_ids)
        side.check_clean()
    finally:
        peer.stop()
        receiver.close()


def test_receiver_lease_expires_without_polling(receiver) -> None:
    dst_ids = receiver("allocate", 1)
    receiver("expect", "lease", dst_ids, 0.3)
    deadline = time.monotonic() + 30  # the receiver's sweep runs every 0.2 s
    while not receiver("metrics").failures.get("lease expired", 0):  # metrics do not sweep
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    assert receiver("poll", "lease").reason == "lease expired"
    receiver("release", "lease")
    receiver("free", dst_ids)


def test_one_receiver_accepts_many_senders(receiver) -> None:
    sides = [make_side(16, seed=SEED + i, ucx=True) for i in range(3)]
    senders = [make_sender("ucx", s.kv, fingerprint()) for s in sides]
    jobs = []
    for i, (side, sender) in enumerate(zip(sides, senders, strict=True)):
        src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 2)
        dest = receiver("expect", f"m{i}", dst_ids, 30.0)
        jobs.append((f"m{i}", side, src_ids, dst_ids, sender.send(dest, src_ids, first_token=i)))
    for rid, side, src_ids, dst_ids, fut in jobs:
        assert fut.result(timeout=20).state is TransferState.DONE
        assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
        receiver("release", rid)
        receiver("free", dst_ids)
        side.pool.free(src_ids)
    for side, sender in zip(sides, senders, strict=True):
        sender.close()
        side.check_clean()


class _CancelledOnResolve(Future):
    """A future that its owner cancels at the moment the sender resolves it: the prefill
    worker cancels one on its gRPC thread when it stops waiting (kv_ack_timeout_s, as
    the sender's own timeout), and the two may meet."""

    def set_exception(self, exception) -> None:
        self.cancel()
        super().set_exception(exception)


def test_a_transfer_cancelled_as_its_ack_is_resolved_leaves_the_others_alone(
    receiver, prefill
) -> None:
    # The sender's ack reader raised InvalidStateError, took it for a lost connection
    # and failed every transfer in flight to that decode worker with "peer lost".
    side, sender = prefill
    src = {rid: side.pool.allocate(2) for rid in "AC"}
    dst = {rid: receiver("allocate", 2) for rid in "AC"}
    dest = {rid: receiver("expect", rid, dst[rid], 30.0) for rid in "AC"}
    receiver("abort", "A")  # the decode side gave A up: its final ack fails it
    sender.send_layers(dest["C"], src["C"], (0, 1))  # C is in flight meanwhile
    sender.send_layers(dest["A"], src["A"], (0, 1))
    sender._requests["A"].future = _CancelledOnResolve()
    sender.send(dest["A"], src["A"], first_token=1)
    deadline = time.monotonic() + 20
    while "A" in sender._requests:  # until its ack has come and been resolved
        assert time.monotonic() < deadline, "A's ack never came"
        time.sleep(0.01)
    assert sender.send(dest["C"], src["C"], first_token=2).result(timeout=20).state is (
        TransferState.DONE
    )
    assert torch.equal(receiver("blocks", dst["C"]), side.kv[:, :, src["C"]])
    assert sender.metrics.failures == {}  # A's decode side gave it up: no failure either
    for rid in "AC":
        receiver("release", rid)
        receiver("free", dst[rid])
        side.pool.free(src[rid])


def test_stray_headers_are_discarded_and_the_connection_keeps_working(receiver, prefill) -> None:
    side, sender = prefill
    src_ids, dst_ids = side.pool.allocate(2), receiver("allocate", 2)
    live = receiver("expect", "live", dst_ids, 30.0)
    stray = Destination(live.address, "nobody", live.block_ids)  # blocks of another request
    sender.send_layers(stray, src_ids, (0, 2))
    with pytest.raises(TransferError, match="unknown request"):
        sender.send(stray, src_ids, first_token=1).result(timeout=20)
    assert not receiver("blocks", dst_ids).any()
    assert receiver("poll", "live").state is TransferState.WAITING
    # Same connection, next request.
    assert sender.send(live, src_ids, first_token=2).result(timeout=20).state is (
        TransferState.DONE
    )
    assert torch.equal(receiver("blocks", dst_ids), side.kv[:, :, src_ids])
    receiver("release", "live")
    receiver("free", dst_ids)
    side.pool.free(src_ids)


def test_close_waits_for_a_read_in_flight_then_lets_the_senders_cache_go(monkeypatch) -> None:
    """Closing a receiver while a connection still reads must run that connection's
    cleanup (its requests, the sender's key) before the thread pool it needs goes."""
    src, dst = make_side(8, seed=SEED, ucx=True), make_side(8)
    receiver = make_receiver("ucx", dst.kv, fingerprint())
    sender = make_sender("ucx", src.kv, fingerprint(), ack_timeout_s=60)
    reading, removed = threading.Event(), []
    read, remove = receiver._cache.read, receiver._cache.remove_remote

    def slow_read(*args, **kwargs):
        reading.set()
        time.sleep(1.5)  # longer than close() used to wait for its connections
        return read(*args, **kwargs)

    def counted_remove(remote):
        removed.append(remote)
        remove(remote)

    monkeypatch.setattr(receiver._cache, "read", slow_read)
    monkeypatch.setattr(receiver._cache, "remove_remote", counted_remove)
    try:
        src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
        sent = sender.send(receiver.expect("c", dst_ids, lease_s=60), src_ids, first_token=1)
        assert reading.wait(30), "the read never started"
        receiver.close()
        assert len(removed) == 1, "the sender's key was not let go"
        with pytest.raises(TransferError):
            sent.result(timeout=60)
    finally:
        sender.close()
        receiver.close()
