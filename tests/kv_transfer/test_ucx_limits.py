"""What a UCX receiver lets in: connections to its host only, payloads its reservations fit."""

from __future__ import annotations

import socket
import time

import psutil
import pytest
import torch

import tandem.kv_transfer.ucx.receiver as ucx_receiver
from tandem.kv_transfer import TransferState, make_receiver, make_sender
from tandem.kv_transfer.payload import gather, make_header
from tandem.kv_transfer.ucx import sockets
from tests.kv_transfer import ucx_raw
from tests.kv_transfer.conftest import fingerprint, make_side

pytest.importorskip("ucxx")


def _other_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(("host", "elsewhere"), [("127.0.0.1", False), ("0.0.0.0", True)])
def test_the_listener_takes_connections_to_its_host_only(host: str, elsewhere: bool) -> None:
    # "0.0.0.0" is the control: the same check passes there, so the other address is
    # reachable at all and it is the restriction to 127.0.0.1 that keeps it out.
    other = _other_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    receiver = make_receiver("ucx", make_side(4).kv, fingerprint(), host=host)
    sender = make_sender("ucx", make_side(4).kv, fingerprint())
    try:
        assert _reachable(other, receiver.port) is elsewhere
        sender.connect(f"127.0.0.1:{receiver.port}")  # the KV protocol works on loopback
    finally:
        sender.close()
        receiver.close()


def test_listen_addresses() -> None:
    assert sockets.listen_addresses("0.0.0.0") == sockets.listen_addresses("") == []
    assert sockets.listen_addresses("localhost") == ["127.0.0.1"]
    assert sockets.listen_addresses("127.0.0.1") == ["127.0.0.1"]


class _StagingSpy:
    """Stands in for ``torch`` in ucx/receiver.py: records every buffer it allocates."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def empty(self, size, **kwargs) -> torch.Tensor:
        self.sizes.append(size)
        return torch.empty(size, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _wait(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_header_over_its_reservation_is_refused_before_staging(monkeypatch) -> None:
    spy = _StagingSpy()
    monkeypatch.setattr(ucx_receiver, "torch", spy)
    side = make_side(16, seed=5)
    before = side.kv.clone()
    receiver = make_receiver("ucx", side.kv, fingerprint(), max_request_blocks=4)
    src = make_side(8, seed=6)
    try:
        other_ids, big_ids = side.pool.allocate(2), side.pool.allocate(2)
        receiver.expect("other", other_ids, lease_s=30)
        receiver.expect("big", big_ids, lease_s=30)
        ok = gather(src.kv, [0, 1], (0, 1))  # 2 blocks x 1 layer: 4096 bytes
        ok_header = make_header("other", (0, 1), (0, 1), tuple(other_ids), ok)
        # 3 blocks x 4 layers (24576 bytes) for a reservation of 2 blocks (16384 at most).
        big = gather(src.kv, [0, 1, 2], (0, 4))
        spare = next(b for b in range(16) if b not in other_ids + big_ids)
        big_header = make_header("big", (0, 4), (0, 1, 2), (*big_ids, spare), big)
        # Unknown request, 5 blocks: more than any reservation here (max_request_blocks 4).
        stray = gather(src.kv, [0, 1, 2, 3, 4], (0, 1))
        stray_header = make_header("nobody", (0, 1), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4), stray)

        async def connect_and_send(*frames):
            ep = await ucx_raw.connect(receiver.address)
            assert (await ucx_raw.handshake(ep, fingerprint(), receiver.address)).error == ""
            for header, payload in frames:
                await ucx_raw.send_frame(ep, header, payload)
            return ep

        ep = ucx_raw.run(connect_and_send((ok_header, ok)))
        _wait(lambda: receiver.poll("other").bytes > 0, "the legitimate frame never landed")
        ucx_raw.run(ucx_raw.send_frame(ep, big_header))  # refused: its payload is never read
        _wait(lambda: receiver.poll("other").state is TransferState.FAILED, "peer not dropped")
        got = receiver.poll("big")
        assert (got.state, got.reason) == (TransferState.FAILED, "bad header")
        assert "payload of 24576 bytes for layers [0, 4) over the 16384 bytes" in got.detail
        assert receiver.poll("other").reason == "peer lost"  # its connection broke protocol
        assert [s for s in spy.sizes if s] == [4096]  # the legitimate frame's staging only
        assert ucx_raw.run(ucx_raw.closed(ep))
        ep.abort()

        ep = ucx_raw.run(connect_and_send((stray_header, None)))
        assert ucx_raw.run(ucx_raw.closed(ep))
        ep.abort()
        assert [s for s in spy.sizes if s] == [4096]
        assert receiver.metrics.messages_discarded == 0
        assert torch.equal(side.kv[1:], before[1:])  # only layer 0 of "other" was written
        assert torch.equal(side.kv[0, :, big_ids], before[0, :, big_ids])

        # Legitimate traffic is unaffected.
        sender = make_sender("ucx", src.kv, fingerprint())
        dest = receiver.expect("fine", side.pool.allocate(4), lease_s=30)
        assert sender.send(dest, [0, 1, 2, 3], first_token=1).result(20).state is (
            TransferState.DONE
        )
        assert torch.equal(side.kv[:, :, list(dest.block_ids)], src.kv[:, :, [0, 1, 2, 3]])
        sender.close()
    finally:
        receiver.close()
