"""The receiver state machine and the sender bookkeeping, through the in-process backend."""

from __future__ import annotations

import threading

import pytest
import torch

import tandem.kv_transfer.inproc as inproc_mod
from tandem.errors import ConfigError
from tandem.kv_transfer import (
    Destination,
    HandshakeError,
    TransferError,
    TransferState,
    make_receiver,
    make_sender,
)
from tandem.kv_transfer.payload import copy_blocks, make_header
from tests.kv_transfer.conftest import Side, fingerprint, make_side


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def link(fp):
    """(prefill side, decode side, sender, receiver); checks both pools after the test."""
    src, dst = make_side(32, seed=11), make_side(32)
    sender = make_sender("inproc", src.kv, fp)
    receiver = make_receiver("inproc", dst.kv, fp)
    yield src, dst, sender, receiver
    sender.close()
    receiver.close()
    src.check_clean()
    dst.check_clean()


def _blocks_equal(src: Side, src_ids, dst: Side, dst_ids, layers=slice(None)) -> bool:
    return all(
        torch.equal(src.kv[layers, :, s], dst.kv[layers, :, d])
        for s, d in zip(src_ids, dst_ids, strict=False)
    )


def test_whole_request_arrives_bit_identical_at_other_unordered_ids(link) -> None:
    src, dst, sender, receiver = link
    src.pool.allocate(5)  # so the two pools hand out different ids
    src_ids = src.pool.allocate(4)[::-1]
    dst_ids = dst.pool.allocate(6)  # reserved for prompt + output; the prompt fills 4
    dst_ids = [dst_ids[i] for i in (3, 0, 5, 1, 4, 2)]
    dest = receiver.expect("r1", dst_ids, lease_s=30)
    assert dest == Destination(receiver.address, "r1", tuple(dst_ids))
    assert receiver.poll("r1").state is TransferState.WAITING

    status = sender.send(dest, src_ids, first_token=42).result(timeout=30)

    assert status.state is TransferState.DONE and status.bytes == 4 * 4 * 2 * 16 * 2 * 8 * 4
    got = receiver.poll("r1")
    assert (got.state, got.first_token, got.bytes) == (TransferState.DONE, 42, status.bytes)
    assert _blocks_equal(src, src_ids, dst, dst_ids[:4])
    assert not dst.kv[:, :, dst_ids[4:]].any()  # reserved for output, not written
    assert sender.metrics.transfers_done == receiver.metrics.transfers_done == 1
    assert sender.metrics.bytes_sent == receiver.metrics.bytes_received == status.bytes
    receiver.release("r1")
    src.pool.free(list(range(5)) + src_ids)
    dst.pool.free(dst_ids)


def test_layer_by_layer_in_any_order(link) -> None:
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(3), dst.pool.allocate(3)[::-1]
    dest = receiver.expect("r", dst_ids, lease_s=30)
    sender.send_layers(dest, src_ids, (2, 4))
    assert receiver.poll("r").state is TransferState.TRANSFERRING
    assert _blocks_equal(src, src_ids, dst, dst_ids, slice(2, 4))
    sender.send_layers(dest, src_ids, (0, 1))
    fut = sender.send(dest, src_ids, first_token=7)  # sends the one layer left, 1
    assert fut.result(timeout=30).state is TransferState.DONE
    assert receiver.poll("r").first_token == 7
    assert _blocks_equal(src, src_ids, dst, dst_ids)
    receiver.release("r")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_final_message_may_carry_no_kv(link) -> None:
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
    dest = receiver.expect("r", dst_ids, lease_s=30)
    sender.send_layers(dest, src_ids, (0, 4))
    assert sender.send(dest, src_ids, first_token=3).result(timeout=30).state is TransferState.DONE
    assert _blocks_equal(src, src_ids, dst, dst_ids)
    receiver.release("r")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_corrupted_blocks_fail_the_request_and_nothing_after_them_is_read(fp) -> None:
    src, dst = make_side(16, seed=12), make_side(16)

    def flip_a_bit_in_layer_1(header, block: torch.Tensor) -> None:
        if header.layer_start == 1:  # the source block changes after its checksum
            block.view(torch.int32).view(-1)[5] ^= 1 << 20

    sender = make_sender("inproc", src.kv, fp, fault_hook=flip_a_bit_in_layer_1)
    receiver = make_receiver("inproc", dst.kv, fp)
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
    dest = receiver.expect("r", dst_ids, lease_s=30)
    sender.send_layers(dest, src_ids, (0, 1))
    sender.send_layers(dest, src_ids, (1, 2))
    fut = sender.send(dest, src_ids, first_token=1)

    with pytest.raises(TransferError) as err:
        fut.result(timeout=30)
    assert err.value.reason == "checksum"
    status = receiver.poll("r")
    assert (status.state, status.reason, status.first_token) == (
        TransferState.FAILED,
        "checksum",
        None,
    )
    # The bad layer landed (it is read before it can be verified) but is never decoded:
    # the request failed; the layers after it were never read.
    assert not dst.kv[2:, :, dst_ids].any(), "layers after the failure reached the blocks"
    assert receiver.metrics.failures == {"checksum": 1}
    assert sender.metrics.failures == {"checksum": 1}
    receiver.release("r")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)
    sender.close()
    receiver.close()
    src.check_clean()
    dst.check_clean()


def test_lease_expiry_fails_and_late_data_is_discarded(link, caplog) -> None:
    src, dst, sender, receiver = link
    clock = FakeClock()
    receiver.core.clock = clock
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
    dest = receiver.expect("r", dst_ids, lease_s=5)
    clock.now += 4.9
    assert receiver.poll("r").state is TransferState.WAITING
    clock.now += 0.2
    status = receiver.poll("r")
    assert (status.state, status.reason) == (TransferState.FAILED, "lease expired")
    dst.pool.free(dst_ids)  # the decode worker takes its blocks back at once

    with pytest.raises(TransferError, match="lease expired"):
        sender.send(dest, src_ids, first_token=1).result(timeout=30)
    assert not dst.kv.any(), "data for an expired lease was written"
    assert receiver.metrics.messages_discarded == 1
    assert receiver.metrics.failures == {"lease expired": 1}
    # Its log lines carry the request's id as every line about a request does (the
    # engine and KV threads have no request context to take it from).
    failed = [r for r in caplog.records if "KV transfer r failed" in r.getMessage()]
    assert failed and all(r.request_id == "r" for r in failed)
    receiver.release("r")
    src.pool.free(src_ids)


def test_renewing_a_lease_keeps_a_waiting_request_and_nothing_else(link) -> None:
    src, dst, sender, receiver = link
    clock = FakeClock()
    receiver.core.clock = clock
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
    dest = receiver.expect("r", dst_ids, lease_s=5)
    for _ in range(4):  # 16 s in all, renewed every 4 s
        clock.now += 4
        assert receiver.renew("r", 5)
    assert receiver.poll("r").state is TransferState.WAITING
    sender.send(dest, src_ids, first_token=1).result(timeout=30)
    assert receiver.poll("r").state is TransferState.DONE
    assert not receiver.renew("r", 5)  # arrived: nothing to renew
    assert not receiver.renew("unknown", 5)
    receiver.expect("late", [dst_ids[0] + 10], lease_s=1)
    clock.now += 2
    assert not receiver.renew("late", 5)  # already past its lease: renewal is too late
    assert receiver.poll("late").reason == "lease expired"
    for rid in ("r", "late"):
        receiver.release(rid)
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_sweep_expires_leases_nobody_polls(link) -> None:
    _, _, _, receiver = link
    clock = FakeClock()
    receiver.core.clock = clock
    receiver.expect("a", [1], lease_s=1)
    receiver.expect("b", [2], lease_s=10)
    clock.now += 2
    assert receiver.core.sweep() == ["a"]
    assert receiver.poll("b").state is TransferState.WAITING


def test_abort_mid_transfer_keeps_later_layers_out(link) -> None:
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(3), dst.pool.allocate(3)
    dest = receiver.expect("r", dst_ids, lease_s=30)
    sender.send_layers(dest, src_ids, (0, 2))
    receiver.abort("r")
    assert receiver.poll("r").reason == "aborted"
    dst.pool.free(dst_ids)
    with pytest.raises(TransferError, match="aborted"):
        sender.send(dest, src_ids, first_token=1).result(timeout=30)
    assert not dst.kv[2:].any()
    # The decode side gave it up: no failure at either end (the sender, told so by the
    # final ack, counted and logged one).
    assert receiver.metrics.failures == {} and sender.metrics.failures == {}
    receiver.release("r")
    src.pool.free(src_ids)


def test_a_transfer_its_owner_gives_up_is_no_failure(link) -> None:
    # A request whose first token ended it, or whose client left before the KV came:
    # each one was counted (and logged as a warning) as a failed transfer, on both sides.
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(4)
    receiver.expect("ended", dst_ids[:2], lease_s=30)
    receiver.release("ended")
    dest = receiver.expect("left", dst_ids[2:], lease_s=30)
    sender.send_layers(dest, src_ids, (0, 1))
    sender.abort("left")
    receiver.release("left")
    assert receiver.metrics.failures == {} and sender.metrics.failures == {}
    dst.pool.free(dst_ids)
    src.pool.free(src_ids)


@pytest.mark.parametrize("how", ["abort", "lease expiry seen by poll"])
def test_failing_waits_for_a_read_in_flight(link, monkeypatch, how: str) -> None:
    """Once a failure is reported nothing writes into the blocks: a copy in flight ends first."""
    src, dst, sender, receiver = link
    clock = FakeClock()
    receiver.core.clock = clock
    entered, proceed, writes_done = threading.Event(), threading.Event(), []
    real_copy = inproc_mod.copy_blocks

    def slow_copy(*args) -> int:
        entered.set()
        proceed.wait(30)
        digest = real_copy(*args)
        writes_done.append(True)
        return digest

    monkeypatch.setattr(inproc_mod, "copy_blocks", slow_copy)
    src_ids, dst_ids = src.pool.allocate(1), dst.pool.allocate(1)
    dest = receiver.expect("r", dst_ids, lease_s=30)
    fut_holder = []
    t = threading.Thread(target=lambda: fut_holder.append(sender.send(dest, src_ids, 1)))
    t.start()
    assert entered.wait(30)
    reported = threading.Event()

    def fail() -> None:
        if how == "abort":
            receiver.abort("r")
        else:
            clock.now += 60
            assert receiver.poll("r").reason == "lease expired"
        reported.set()

    a = threading.Thread(target=fail)
    a.start()
    assert not reported.wait(0.2), "failure reported while a write into the blocks was running"
    proceed.set()
    assert reported.wait(30) and writes_done == [True]
    t.join(5)
    a.join(5)
    with pytest.raises(TransferError, match="aborted" if how == "abort" else "lease expired"):
        fut_holder[0].result(timeout=30)
    assert receiver.poll("r").state is TransferState.FAILED
    receiver.release("r")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_data_for_an_unknown_request_is_discarded(link) -> None:
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)
    receiver.expect("live", dst_ids, lease_s=30)
    stray = Destination(receiver.address, "gone", tuple(dst_ids))  # someone else's blocks
    with pytest.raises(TransferError, match="unknown request"):
        sender.send(stray, src_ids, first_token=1).result(timeout=30)
    assert not dst.kv.any()
    assert receiver.poll("live").state is TransferState.WAITING
    receiver.release("live")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_sender_abort_fails_the_reservation(link) -> None:
    src, dst, sender, receiver = link
    src_ids, dst_ids = src.pool.allocate(1), dst.pool.allocate(1)
    dest = receiver.expect("r", dst_ids, lease_s=30)
    sender.send_layers(dest, src_ids, (0, 1))
    sender.abort("r")
    assert receiver.poll("r").reason == "aborted by sender"
    sender.send_layers(dest, src_ids, (1, 2))  # a prefill loop that has not noticed yet
    with pytest.raises(TransferError, match="aborted"):
        sender.send(dest, src_ids, first_token=1).result(timeout=30)
    assert not dst.kv[1:].any()
    receiver.release("r")
    src.pool.free(src_ids)
    dst.pool.free(dst_ids)


def test_handshake_mismatch_names_both_values() -> None:
    src, dst = make_side(4), make_side(4)
    sender = make_sender("inproc", src.kv, fingerprint(block_size=32))
    receiver = make_receiver("inproc", dst.kv, fingerprint())
    dest = receiver.expect("r", [0], lease_s=30)
    with pytest.raises(HandshakeError, match="block_size: prefill 32, decode 16"):
        sender.send(dest, [0], first_token=1).result(timeout=30)
    assert receiver.poll("r").state is TransferState.WAITING
    sender.close()
    receiver.close()


def test_header_problems_fail_the_request(link) -> None:
    src, dst, _, receiver = link
    core = receiver.core
    dst_ids = dst.pool.allocate(2)
    receiver.expect("dup", dst_ids, lease_s=30)

    def fill(h):  # what the sender's transport does: read the header's blocks from src
        layers = (h.layer_start, h.layer_end)
        return lambda: copy_blocks(dst.kv, src.kv.data_ptr(), 33, (0, 1), h.dst_block_ids, layers)

    h = make_header("dup", (0, 2), (0, 1), tuple(dst_ids), src.kv)
    core.deliver(h, "src", fill(h))
    core.deliver(h, "src", fill(h))
    assert receiver.poll("dup").reason == "bad header"
    receiver.expect("partial", dst_ids, lease_s=30)
    final = make_header("partial", (0, 2), (0, 1), tuple(dst_ids), src.kv, 5, final=True)
    status = core.deliver(final, "src", fill(final))
    assert (status.state, status.reason) == (TransferState.FAILED, "incomplete")
    receiver.expect("wrong-ids", dst_ids, lease_s=30)
    h = make_header("wrong-ids", (0, 2), (0, 1), tuple(dst_ids[::-1]), src.kv)
    core.deliver(h, "src", fill(h))
    assert (
        receiver.poll("wrong-ids").detail == "destination block ids differ from the reservation's"
    )
    for rid in ("dup", "partial", "wrong-ids"):
        receiver.release(rid)
    dst.pool.free(dst_ids)


def test_expect_rejects_bad_reservations(link) -> None:
    _, _, _, receiver = link
    with pytest.raises(ValueError, match="outside the pool"):
        receiver.expect("r", [32], lease_s=1)  # 32 is the null block
    receiver.expect("r", [1], lease_s=1)
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("r", [2], lease_s=1)
    receiver.release("r")


def test_many_threads_share_one_receiver(link) -> None:
    src, dst, sender, receiver = link
    jobs = []
    for i in range(16):
        src_ids, dst_ids = src.pool.allocate(2), dst.pool.allocate(2)[::-1]
        jobs.append((f"r{i}", src_ids, dst_ids, receiver.expect(f"r{i}", dst_ids, 30)))
    errors = []

    def push(job) -> None:
        rid, src_ids, _, dest = job
        try:
            for layer in range(3):
                sender.send_layers(dest, src_ids, (layer, layer + 1))
            sender.send(dest, src_ids, first_token=int(rid[1:])).result(timeout=10)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    for rid, src_ids, dst_ids, _ in jobs:
        assert receiver.poll(rid).first_token == int(rid[1:])
        assert _blocks_equal(src, src_ids, dst, dst_ids)
        receiver.release(rid)
        src.pool.free(src_ids)
        dst.pool.free(dst_ids)


@pytest.mark.parametrize("first_done", [True, False], ids=["after-done", "mid-transfer"])
def test_a_second_sender_is_refused_and_leaves_the_first_ones_request_alone(
    link, fp, first_done: bool
) -> None:
    # A router that retried prefill elsewhere: the worker it gave up on may already
    # have delivered (or be delivering) this request's KV.
    src, dst, first, receiver = link
    other_side = make_side(32, seed=12)
    second = make_sender("inproc", other_side.kv, fp)
    try:
        src_ids, other_ids = src.pool.allocate(3), other_side.pool.allocate(3)
        dst_ids = dst.pool.allocate(3)
        dest = receiver.expect("r", dst_ids, lease_s=30)
        if first_done:
            assert first.send(dest, src_ids, first_token=7).result(5).state is TransferState.DONE
        else:
            first.send_layers(dest, src_ids, (0, 2))
        with pytest.raises(TransferError) as err:
            second.send(dest, other_ids, first_token=8).result(5)
        assert err.value.reason == "another sender"
        if not first_done:
            assert receiver.poll("r").state is TransferState.TRANSFERRING
            assert first.send(dest, src_ids, first_token=7).result(5).state is TransferState.DONE
        got = receiver.poll("r")
        assert (got.state, got.first_token) == (TransferState.DONE, 7)
        assert _blocks_equal(src, src_ids, dst, dst_ids)
        receiver.release("r")
        src.pool.free(src_ids)
        dst.pool.free(dst_ids)
        other_side.pool.free(other_ids)
        other_side.check_clean()
    finally:
        second.close()


def test_the_owner_is_told_each_time_a_reservation_ends(link) -> None:
    src, dst, sender, receiver = link
    ended = []
    receiver.notify(lambda: ended.append(1))  # called under the receiver's lock
    clock = FakeClock()
    receiver.core.clock = clock
    src_ids = src.pool.allocate(2)
    ids = {rid: dst.pool.allocate(2) for rid in ("done", "aborted", "expired")}
    dests = {rid: receiver.expect(rid, blocks, lease_s=5) for rid, blocks in ids.items()}
    assert not ended
    assert sender.send(dests["done"], src_ids, first_token=3).result(5).state is TransferState.DONE
    assert len(ended) == 1
    receiver.abort("aborted")
    clock.now += 6
    assert receiver.core.sweep() == ["expired"]
    assert len(ended) == 3
    receiver.abort("aborted")  # already over: nothing ends twice
    assert len(ended) == 3
    # A callback that raises is logged; the transfer it reports on is not disturbed.
    receiver.notify(lambda: 1 / 0)
    more = receiver.expect("more", dst.pool.allocate(2), lease_s=5)
    assert sender.send(more, src_ids, first_token=4).result(5).state is TransferState.DONE
    for rid in (*ids, "more"):
        receiver.release(rid)
    dst.pool.free([b for blocks in ids.values() for b in blocks] + list(more.block_ids))
    src.pool.free(src_ids)


@pytest.mark.parametrize("make", [make_sender, make_receiver])
def test_a_cache_off_the_host_is_refused_by_name(make, fp) -> None:
    # Its copies are memmoves: a CUDA cache's pointers crashed the process. (A "meta"
    # tensor stands in for a device cache here.)
    kv = torch.empty(make_side(4).kv.shape, device="meta")
    with pytest.raises(ConfigError, match="inproc copies KV caches in host memory only, and "
                       "this one is on meta; use kv_backend: ucx"):  # fmt: skip
        make("inproc", kv, fp)
