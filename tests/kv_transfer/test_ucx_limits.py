"""What a UCX receiver lets in: connections to its host only, reads its reservations fit."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tandem.kv_transfer import TransferState, make_receiver, make_sender
from tandem.kv_transfer.payload import make_header
from tandem.kv_transfer.ucx import sockets
from tandem.kv_transfer.ucx.rma import CacheMemory
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


def _wait(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_headers_outside_their_reservations_read_nothing() -> None:
    side = make_side(16, seed=5)
    before = side.kv.clone()
    receiver = make_receiver("ucx", side.kv, fingerprint(), max_request_blocks=4)
    src = make_side(8, seed=6)
    cache = CacheMemory(src.kv)
    try:
        other_ids, big_ids = side.pool.allocate(2), side.pool.allocate(2)
        receiver.expect("other", other_ids, lease_s=30)
        receiver.expect("big", big_ids, lease_s=30)
        ok = make_header("other", (0, 1), (0, 1), tuple(other_ids), src.kv)
        # 3 blocks for a reservation of 2: the third destination is someone else's.
        spare = next(b for b in range(16) if b not in other_ids + big_ids)
        big = make_header("big", (0, 4), (0, 1, 2), (*big_ids, spare), src.kv)
        # Source blocks past the sender's pool (8 blocks): refused before any read.
        far = make_header("other", (1, 2), (0, 9), tuple(other_ids), src.kv)
        stray = make_header("nobody", (0, 1), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4), src.kv)

        async def client():
            ep = await ucx_raw.connect(receiver.address)
            assert (await ucx_raw.handshake(ep, fingerprint(), receiver.address)).error == ""
            await ucx_raw.send_cache(ep, cache)
            for header in (ok, big, stray):
                await ucx_raw.send_frame(ep, header)
            return ep

        ep = ucx_raw.run(client())
        _wait(lambda: receiver.metrics.messages_discarded == 2, "big and stray not discarded")
        got = receiver.poll("big")
        assert (got.state, got.reason) == (TransferState.FAILED, "bad header")
        assert receiver.poll("other").bytes == ok.nbytes  # read, and the connection lives
        ucx_raw.run(ucx_raw.send_frame(ep, far))
        _wait(lambda: receiver.poll("other").state is TransferState.FAILED, "far not refused")
        assert "source block ids [9] outside the sender's pool" in receiver.poll("other").detail
        changed = side.kv != before
        assert torch.equal(side.kv[0, :, other_ids], src.kv[0, :, [0, 1]])
        changed[0, :, other_ids] = False  # only layer 0 of "other" was written
        assert not changed.any()
        ep.abort()

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
        cache.close()


CLOSE_AFTER_CONNECT = """
from tandem.kv_transfer import make_receiver, make_sender
from tests.kv_transfer.conftest import fingerprint, make_side

for _ in range(100):
    receiver = make_receiver("ucx", make_side(4).kv, fingerprint(), host="127.0.0.1")
    sender = make_sender("ucx", make_side(4).kv, fingerprint())
    try:
        sender.connect(f"127.0.0.1:{receiver.port}")
    finally:
        sender.close()
        receiver.close()
"""

# The receiver reading with UCX gets (as across hosts), closed with reads in flight.
CLOSE_DURING_READS = """
import time
from tandem.kv_transfer import make_receiver, make_sender
from tests.kv_transfer.conftest import fingerprint, make_side

for i in range(40):
    here, there = make_side(64), make_side(64, seed=1, ucx=True)
    receiver = make_receiver("ucx", here.kv, fingerprint(), host="127.0.0.1", map_peers=False)
    sender = make_sender("ucx", there.kv, fingerprint())
    try:
        sender.connect(f"127.0.0.1:{receiver.port}")
        for r in range(4):
            dest = receiver.expect(f"r{r}", here.pool.allocate(12), lease_s=30)
            sender.send(dest, there.pool.allocate(12), first_token=1)
        time.sleep(0.001 * (i % 5))
    finally:
        receiver.close()
        sender.close()
"""


# Keeps a core busy; it ends by itself if this test's process dies without killing it.
BUSY = """
import os, time
parent, end = os.getppid(), time.monotonic() + 300
while os.getppid() == parent and time.monotonic() < end:
    pass
"""


@pytest.mark.parametrize("script", [CLOSE_AFTER_CONNECT, CLOSE_DURING_READS],
                         ids=["after-connect", "during-reads"])  # fmt: skip
def test_a_receiver_closed_at_any_moment_never_uses_a_freed_endpoint(script: str) -> None:
    # The receiver unpacks the sender's memory key on the connection's UCX endpoint and
    # (reading with gets) posts its reads there; closing frees the endpoint. The
    # unpack ran on a pool thread and a read could be posted after the close: while
    # another process kept a core busy, every process of five (after connect) and of
    # three (during reads) segfaulted before the fix. A process of its own, so that a
    # crash fails this test rather than ending the run.
    root = Path(__file__).resolve().parents[2]
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        run = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", script],
            cwd=root, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        busy.kill()
        busy.wait()
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_stalled_read_holds_the_senders_frames_back_and_fails_no_request(monkeypatch) -> None:
    # Frames over UCX (no mailbox, as between hosts): while one read stalls, a busy
    # sender's layer-by-layer frames pile up past the receiver's queue. They wait in
    # UCX; dropping the connection would fail every request on it.
    from tandem.kv_transfer import TransferError
    from tandem.kv_transfer.ucx import mailbox
    from tandem.kv_transfer.ucx import receiver as ucx_receiver
    from tests.kv_transfer.conftest import LAYERS

    monkeypatch.setattr(ucx_receiver, "MAX_QUEUED_FRAMES", 64)
    monkeypatch.setattr(mailbox, "supported", lambda: False)
    read, stalled = CacheMemory.read, []

    def stall_once(*args, **kwargs):
        if not stalled:
            stalled.append(True)
            time.sleep(2.0)
        return read(*args, **kwargs)

    monkeypatch.setattr(CacheMemory, "read", stall_once)
    rside, sside = make_side(200), make_side(200, seed=1, ucx=True)
    receiver = make_receiver("ucx", rside.kv, fingerprint(), map_peers=False)
    sender = make_sender("ucx", sside.kv, fingerprint(), ack_timeout_s=30)
    try:
        futures = []
        for i in range(160 // LAYERS + 1):  # past the queue twice over
            dest = receiver.expect(f"r{i}", rside.pool.allocate(1), 60)
            src = sside.pool.allocate(1)
            for layer in range(LAYERS - 1):
                sender.send_layers(dest, src, (layer, layer + 1))
            futures.append(sender.send(dest, src, 1))
        outcomes = []
        for future in futures:
            try:
                future.result(60)
                outcomes.append("done")
            except TransferError as exc:
                outcomes.append(exc.reason)
        assert stalled and outcomes == ["done"] * len(futures)
    finally:
        sender.close()
        receiver.close()


# A sender that stops answering mid-read (a frozen process: SIGSTOP; over TCP, as
# between hosts without RDMA, where the receiver's gets need the sender's process).
FROZEN_SENDER = """
import os, signal, threading, time
os.environ["UCX_TLS"] = "tcp,self"  # before UCX starts, here and in the spawned sender
from tandem.kv_transfer import TransferState, make_receiver
from tandem.kv_transfer.ucx.rma import CacheMemory
from tests.kv_transfer.conftest import fingerprint, make_side
from tests.kv_transfer.ucx_peer import PeerProcess

read, reading, go = CacheMemory.read, threading.Event(), threading.Event()

def frozen_first(*args, **kwargs):
    reading.set()
    go.wait(30)  # until the sender is stopped
    return read(*args, timeout_s=1.0)

CacheMemory.read = frozen_first
side = make_side(16)
receiver = make_receiver("ucx", side.kv, fingerprint(), map_peers=False)
peer = PeerProcess("sender")
try:
    peer("connect", receiver.address, timeout=60)
    dest = receiver.expect("frozen", side.pool.allocate(2), lease_s=60)
    peer("send", dest, peer("allocate", 2), 7)
    assert reading.wait(30), "no read started"
    os.kill(peer.process.pid, signal.SIGSTOP)
    go.set()
    end = time.monotonic() + 10
    while receiver.poll("frozen", drain=False).state is not TransferState.FAILED:
        assert time.monotonic() < end, "the read outlived its timeout by 9 s"
        time.sleep(0.05)
    status = receiver.poll("frozen", drain=False)
    assert status.reason in ("timeout", "peer lost"), status
    assert receiver.release("frozen", wait=False), "its blocks still wait for the read"
finally:
    os.kill(peer.process.pid, signal.SIGKILL)
    receiver.close()
"""


def test_a_read_from_a_sender_that_stopped_answering_ends_at_its_timeout() -> None:
    # UCX cancels tag receives only: a get ended only when it landed or its endpoint
    # failed, so a frozen sender held the reservation's blocks and the connection's
    # thread for as long as it stayed frozen (69 s of a 65 s freeze, with a 1 s
    # timeout). Past the timeout the connection is now dropped, which ends the reads.
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", FROZEN_SENDER],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
