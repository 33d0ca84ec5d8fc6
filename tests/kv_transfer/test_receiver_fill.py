"""ReceiverCore.deliver with ``fill``: a transport that reads blocks in place (ucx/rma.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.kv_transfer import TransferError, TransferState
from tandem.kv_transfer.payload import make_header
from tandem.kv_transfer.receiver import ReceiverCore
from tests.kv_transfer.conftest import LAYERS, fingerprint, make_side


def _setup(n: int = 3):
    src, dst = make_side(16, seed=4), make_side(16)
    core = ReceiverCore(dst.kv, fingerprint(), "test")
    src_ids, dst_ids = src.pool.allocate(n), dst.pool.allocate(n)[::-1]
    core.expect("r", dst_ids, lease_s=30)
    header = make_header("r", (0, LAYERS), tuple(src_ids), tuple(dst_ids), src.kv, 7, True)
    return src, dst, core, src_ids, dst_ids, header


def _copy(src, dst, src_ids, dst_ids):
    def fill() -> None:
        dst.kv[:, :, dst_ids] = src.kv[:, :, src_ids]

    return fill


def test_a_fill_lands_and_is_verified_in_place() -> None:
    src, dst, core, src_ids, dst_ids, header = _setup()
    status = core.deliver(header, fill=_copy(src, dst, src_ids, dst_ids))
    assert (status.state, status.first_token) == (TransferState.DONE, 7)
    assert torch.equal(dst.kv[:, :, dst_ids], src.kv[:, :, src_ids])


@pytest.mark.parametrize("digest", ["right", "wrong"])
def test_a_fill_that_hashed_as_it_copied_is_taken_at_its_word(digest: str) -> None:
    src, dst, core, src_ids, dst_ids, header = _setup()
    copy = _copy(src, dst, src_ids, dst_ids)

    def hashing() -> int:
        copy()
        return header.checksum if digest == "right" else header.checksum ^ 1

    status = core.deliver(header, fill=hashing)
    want = (TransferState.DONE, "") if digest == "right" else (TransferState.FAILED, "checksum")
    assert (status.state, status.reason) == want


def test_a_fill_that_lands_other_bytes_fails_the_checksum() -> None:
    src, dst, core, src_ids, dst_ids, header = _setup()
    copy = _copy(src, dst, src_ids, dst_ids)

    def corrupted() -> None:
        copy()
        dst.kv[1, 0, dst_ids[0], 0, 0, 0] += 1

    status = core.deliver(header, fill=corrupted)
    assert (status.state, status.reason) == (TransferState.FAILED, "checksum")


def test_a_failed_read_fails_the_request_with_its_reason() -> None:
    *_, core, _, _, header = _setup()

    def lost() -> None:
        raise TransferError("peer lost", "UCX read: disconnected")

    status = core.deliver(header, fill=lost)
    assert (status.state, status.reason) == (TransferState.FAILED, "peer lost")


def test_abort_returns_only_once_a_read_in_flight_has_landed() -> None:
    src, dst, core, src_ids, dst_ids, header = _setup()
    started, finished = threading.Event(), []
    copy = _copy(src, dst, src_ids, dst_ids)

    def slow() -> None:
        started.set()
        time.sleep(0.3)
        copy()
        finished.append(time.monotonic())

    reader = threading.Thread(target=core.deliver, args=(header,), kwargs={"fill": slow})
    reader.start()
    assert started.wait(5)
    core.abort("r")
    aborted_at = time.monotonic()
    reader.join(5)
    assert finished and finished[0] <= aborted_at  # nothing lands after abort returned
    assert core.poll("r").reason == "aborted"


def test_a_release_that_does_not_wait_leaves_a_read_in_flight_to_finish() -> None:
    src, dst, core, src_ids, dst_ids, header = _setup()
    started, go = threading.Event(), threading.Event()
    copy = _copy(src, dst, src_ids, dst_ids)

    def stalled() -> None:  # a peer that answers late
        started.set()
        assert go.wait(5)
        copy()

    reader = threading.Thread(target=core.deliver, args=(header,), kwargs={"fill": stalled})
    reader.start()
    assert started.wait(5)
    begun = time.monotonic()
    assert core.release("r", wait=False) is False  # not waited for: the blocks stay its
    assert time.monotonic() - begun < 0.5
    assert core.poll("r", drain=False).state is TransferState.FAILED  # no new read starts
    assert core.release("r", wait=False) is False
    go.set()
    reader.join(5)
    assert core.release("r", wait=False) is True  # the read is over: the caller may free
    with pytest.raises(KeyError):
        core.poll("r")
    assert core.release("r", wait=False) is True  # an unknown request: nothing to wait for


def test_no_read_is_posted_for_a_request_that_is_gone() -> None:
    *_, core, _, _, header = _setup()
    core.release("r")
    called = []
    status = core.deliver(header, fill=lambda: called.append(1))
    assert status.state is TransferState.FAILED and not called


def test_a_message_with_kv_needs_a_fill() -> None:
    *_, core, _, _, header = _setup()
    with pytest.raises(ValueError, match="needs a fill"):
        core.deliver(header)
