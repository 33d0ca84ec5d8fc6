"""ReceiverCore's bounds on what a header may announce, checked before any staging."""

from __future__ import annotations

import pytest

from tandem.kv_transfer import TransferState
from tandem.kv_transfer.payload import MessageHeader
from tandem.kv_transfer.receiver import ReceiverCore
from tests.kv_transfer.conftest import (
    BLOCK_SIZE,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
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


def test_a_live_reservation_bounds_its_payloads() -> None:
    core = _core()
    core.expect("r", [4, 9, 2], lease_s=30)
    assert BLOCK_LAYER == 2048
    assert core.payload_limit(_header("r", (1, 3), 3)) == 3 * 2 * 2048
    assert core.payload_limit(_header("r", (0, LAYERS), 40)) == 3 * LAYERS * 2048
    # More layers than the KV has: bounded by the KV's layers (check_fits refuses it later).
    assert core.payload_limit(_header("r", (0, 10), 1)) == 3 * LAYERS * 2048


def test_late_data_is_bounded_by_the_largest_possible_reservation() -> None:
    core = _core(max_request_blocks=5)
    assert core.payload_limit(_header("nobody", (0, 2), 9)) == 5 * 2 * 2048
    core.expect("r", [1, 2], lease_s=30)
    core.abort("r")  # finished: its late data must still be drained, up to 5 blocks
    assert core.payload_limit(_header("r", (0, 1), 4)) == 5 * 1 * 2048
    assert _core().payload_limit(_header("x", (0, 1), 1)) == 32 * 2048  # default: the pool


def test_max_request_blocks_is_checked_and_enforced_by_expect() -> None:
    with pytest.raises(ValueError, match="max_request_blocks must be >= 1, got 0"):
        _core(max_request_blocks=0)
    assert _core(max_request_blocks=1000).max_request_blocks == 32  # no more than the pool
    core = _core(max_request_blocks=4)
    with pytest.raises(ValueError, match="5 blocks, more than max_request_blocks 4"):
        core.expect("r", [0, 1, 2, 3, 4], lease_s=30)
    core.expect("r", [0, 1, 2, 3], lease_s=30)


def test_reject_fails_the_request_unless_another_connection_feeds_it() -> None:
    core = _core()
    mine, other = object(), object()
    core.expect("r", [0, 1], lease_s=30)
    core.reject(_header("r", (0, 4), 5), mine, "too big")
    status = core.poll("r")
    assert (status.state, status.reason, status.detail) == (
        TransferState.FAILED,
        "bad header",
        "too big",
    )
    core.expect("fed", [2, 3], lease_s=30)
    core.deliver(_header("fed", (0, 0), 2, first=2), None, source=other)  # layers: none yet
    core.reject(_header("fed", (0, 4), 5), mine, "too big")
    assert core.poll("fed").state is TransferState.TRANSFERRING
    core.reject(_header("nobody", (0, 1), 1), mine, "too big")  # unknown: nothing to fail
