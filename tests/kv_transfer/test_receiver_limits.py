"""ReceiverCore's bounds: what a reservation may be, what a header may name."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from tandem.kv_transfer import TransferState
from tandem.kv_transfer.payload import MessageHeader
from tandem.kv_transfer.receiver import ReceiverCore
from tests.kv_transfer.conftest import (
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    fingerprint,
    make_side,
)

BLOCK_LAYER = 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4  # K and V of one layer, float32: 2048


def _header(rid: str, layers: tuple[int, int], n: int, first: int = 0) -> MessageHeader:
    """A header for ``n`` blocks from ``first`` on (no payload needed: nothing reads it)."""
    shape = (layers[1] - layers[0], 2, n, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return MessageHeader(
        request_id=rid,
        layer_start=layers[0],
        layer_end=layers[1],
        src_block_ids=tuple(range(n)),
        dst_block_ids=tuple(range(first, first + n)),
        dtype="float32",
        shape=shape,
        nbytes=shape[0] * n * BLOCK_LAYER,
        checksum=0,
    )


def _core(num_blocks: int = 32, max_request_blocks: int | None = None) -> ReceiverCore:
    kv = make_side(num_blocks).kv
    return ReceiverCore(kv, fingerprint(), "test", max_request_blocks=max_request_blocks)


def test_max_request_blocks_is_checked_and_enforced_by_expect() -> None:
    with pytest.raises(ValueError, match="max_request_blocks must be >= 1, got 0"):
        _core(max_request_blocks=0)
    assert _core(max_request_blocks=1000).max_request_blocks == 32  # no more than the pool
    core = _core(max_request_blocks=4)
    with pytest.raises(ValueError, match="5 blocks, more than max_request_blocks 4"):
        core.expect("r", [0, 1, 2, 3, 4], lease_s=30)
    core.expect("r", [0, 1, 2, 3], lease_s=30)


def test_a_header_beyond_its_reservation_fails_it_without_a_read() -> None:
    core = _core()
    core.expect("r", [4, 5], lease_s=30)
    reads = []
    # Three blocks for a reservation of two: the third would land in someone else's.
    status = core.deliver(_header("r", (0, 1), 3, first=4), "peer", lambda: reads.append(1))
    assert status is None and reads == []
    got = core.poll("r")
    assert (got.state, got.reason) == (TransferState.FAILED, "bad header")
    assert "destination block ids differ from the reservation's" in got.detail
    # Unknown requests are discarded unread, and their final message is answered.
    final = dataclasses.replace(_header("nobody", (0, 1), 1), final=True)
    answer = core.deliver(final, "peer", lambda: reads.append(1))
    assert (answer.state, answer.reason) == (TransferState.FAILED, "unknown request")
    assert reads == [] and core.metrics.messages_discarded == 2  # both, unread


def test_a_late_final_message_for_a_released_request_is_told_why_it_ended() -> None:
    # The decode worker releases a request it gave up, or whose lease ran out, at once;
    # the prefill worker's final message then met no reservation and was answered
    # "unknown request", which its sender counted and logged as a transfer failure,
    # and which hid an expired lease.
    now = [0.0]
    core = ReceiverCore(make_side(32).kv, fingerprint(), "test", clock=lambda: now[0])
    final = lambda rid: dataclasses.replace(_header(rid, (0, 1), 1), final=True)  # noqa: E731
    core.expect("given-up", [0], lease_s=30)
    core.release("given-up")
    core.expect("expired", [1], lease_s=1)
    now[0] = 2.0
    assert core.sweep() == ["expired"]
    core.release("expired")
    answers = {rid: core.deliver(final(rid), "peer", lambda: None).reason
               for rid in ("given-up", "expired", "nobody")}  # fmt: skip
    assert answers == {"given-up": "aborted", "expired": "lease expired",
                       "nobody": "unknown request"}  # fmt: skip
    assert core.metrics.failures == {"lease expired": 1}
    core.expect("given-up", [3], lease_s=30)  # the id again: a new reservation
    assert core.poll("given-up").state is TransferState.WAITING


def test_a_read_that_does_not_end_holds_up_no_other_leases_expiry() -> None:
    # A UCX read from a sender that stopped answering (a frozen process) ends only when
    # it lands or its endpoint fails. The sweep waited for it, and with it every other
    # lease's expiry: reservations nobody polled kept their blocks.
    now = [0.0]
    core = ReceiverCore(make_side(32).kv, fingerprint(), "test", clock=lambda: now[0])
    core.expect("stuck", [0], lease_s=1)
    core.expect("idle", [1], lease_s=2)
    reading, landed = threading.Event(), threading.Event()

    def read() -> None:
        reading.set()
        landed.wait(30)

    delivery = threading.Thread(
        target=core.deliver, args=(_header("stuck", (0, 1), 1), "peer", read)
    )
    delivery.start()
    try:
        assert reading.wait(10)
        now[0] = 3.0
        started = time.monotonic()
        assert sorted(core.sweep()) == ["idle", "stuck"]
        assert time.monotonic() - started < 1
        assert core.release("idle", wait=False)
        assert not core.release("stuck", wait=False)  # its blocks wait for the read
    finally:
        landed.set()
        delivery.join(10)
    assert core.release("stuck", wait=False)


def test_only_the_sender_feeding_a_reservation_can_abort_it() -> None:
    # A prefill retried on another worker shares the reservation; the first worker's
    # abort, sent when its call ended, could arrive after the retry had begun, or before
    # its first layer, and failed the reservation under the retry.
    core = _core()
    core.expect("r", [4], lease_s=30)
    core.sender_abort("r", "first worker")  # fed nothing: not its reservation
    assert core.poll("r").state is TransferState.WAITING
    # Its first layer (the fill returns the checksum of what landed: the header's).
    assert core.deliver(_header("r", (0, 1), 1, first=4), "retry", lambda: 0) is None
    core.sender_abort("r", "first worker")
    assert core.poll("r").state is TransferState.TRANSFERRING
    core.sender_abort("r", "retry")  # the sender feeding it gave up: so does it
    got = core.poll("r")
    assert (got.state, got.reason) == (TransferState.FAILED, "aborted by sender")


@pytest.mark.parametrize("end", ["peer lost", "aborted by sender"])
def test_a_retry_told_of_a_reservation_another_sender_fed_and_lost_hears_another_sender(end):
    # The first prefill worker fed some layers and went away (or its call ended); the
    # decode worker released the failed reservation at once; the router's retry on a
    # healthy worker then heard the first one's reason, and put that healthy pair in
    # cooldown for kv_path_cooldown_s.
    core = _core()
    core.expect("r", [4], lease_s=30)
    assert core.deliver(_header("r", (0, 1), 1, first=4), "first", lambda: 0) is None
    if end == "peer lost":
        core.source_lost("first")
    else:
        core.sender_abort("r", "first")
    assert core.poll("r").reason == end
    assert core.release("r", wait=False)
    final = dataclasses.replace(_header("r", (1, 2), 1, first=4), final=True)
    assert core.deliver(final, "retry", lambda: 0).reason == "another sender"
    assert core.deliver(final, "first", lambda: 0).reason == end  # its own, it is told


def test_a_retry_is_told_another_sender_once_the_sender_that_fed_it_is_gone() -> None:
    # The feeding sender was remembered by its id(): once its connection was gone, a
    # new one (the router's retry) could get the same address and be told the first
    # one's "peer lost", putting its healthy pair in cooldown after all.
    class Connection:
        pass

    core = _core()
    core.expect("r", [4], lease_s=30)
    first = Connection()
    assert core.deliver(_header("r", (0, 1), 1, first=4), first, lambda: 0) is None
    core.source_lost(first)
    assert core.release("r", wait=False)
    del first  # its connection closed: nothing here keeps it
    retry = Connection()  # made at once, it often takes the first one's address
    final = dataclasses.replace(_header("r", (1, 2), 1, first=4), final=True)
    assert core.deliver(final, retry, lambda: 0).reason == "another sender"
