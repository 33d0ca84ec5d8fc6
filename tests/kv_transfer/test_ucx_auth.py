"""The shared-secret handshake over UCX: strangers, impostors and protocol breakers.

The receiver under attack lives in this process (its log is captured and its KV
tensor read directly); rogue senders run in another process or as raw endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
import torch

from tandem.kv_transfer import (
    HandshakeError,
    TransferMetrics,
    TransferState,
    auth,
    make_receiver,
    make_sender,
)
from tandem.kv_transfer.payload import make_header
from tandem.kv_transfer.ucx import wire
from tandem.kv_transfer.ucx.rma import CacheMemory
from tests.kv_transfer import ucx_raw
from tests.kv_transfer.conftest import fingerprint, make_side
from tests.kv_transfer.ucx_peer import PeerProcess

pytest.importorskip("ucxx")

SECRET = b"the cluster's kv secret, 32 byte"
WRONG = b"a different secret of 32 bytes!!"
SEED = 31
RECEIVER_LOG = "tandem.kv_transfer.ucx.receiver"
REFUSAL = re.compile(r"refused a sender at 127\.0\.0\.1:\d+: KV authentication failed")


@pytest.fixture
def decode(caplog):
    """A receiver with the secret, over random KV (so any write shows), and a snapshot."""
    caplog.set_level(logging.WARNING, logger=RECEIVER_LOG)
    side = make_side(32, seed=SEED + 1)
    receiver = make_receiver("ucx", side.kv, fingerprint(), secret=SECRET)
    yield side, receiver, side.kv.clone()
    receiver.close()


def _wait_for_log(caplog, pattern: re.Pattern, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        for record in caplog.records:
            if record.name == RECEIVER_LOG and pattern.search(record.getMessage()):
                return record.getMessage()
        assert time.monotonic() < deadline, f"no log line matching {pattern.pattern!r}"
        time.sleep(0.02)


def _untouched(kv: torch.Tensor, before: torch.Tensor, written=()) -> bool:
    """Every block but ``written`` still holds its bytes from ``before``."""
    keep = [b for b in range(kv.shape[2]) if b not in set(written)]
    return torch.equal(kv[:, :, keep], before[:, :, keep])


def test_rogue_sender_is_refused_while_the_legitimate_one_transfers(decode, caplog) -> None:
    side, receiver, before = decode
    prefill = make_side(16, seed=SEED)
    legit = make_sender("ucx", prefill.kv, fingerprint(), secret=SECRET)
    rogue = PeerProcess("sender", seed=SEED + 2, secret=WRONG)
    try:
        src_ids, dst_ids = prefill.pool.allocate(3), side.pool.allocate(3)
        dest = receiver.expect("legit", dst_ids, lease_s=30)
        rogue_dst = side.pool.allocate(2)
        rogue_dest = receiver.expect("rogue", rogue_dst, lease_s=30)
        legit.send_layers(dest, src_ids, (0, 2))  # the legitimate connection is mid-transfer

        rogue("send", rogue_dest, rogue("allocate", 2), 7)
        with pytest.raises(HandshakeError, match=auth.FAILED):
            rogue("result", "rogue", 20)
        _wait_for_log(caplog, REFUSAL)

        status = legit.send(dest, src_ids, first_token=5).result(timeout=20)
        assert status.state is TransferState.DONE
        assert torch.equal(side.kv[:, :, dst_ids], prefill.kv[:, :, src_ids])
        assert _untouched(side.kv, before, written=dst_ids)
        assert receiver.poll("rogue").state is TransferState.WAITING
        assert receiver.metrics == TransferMetrics(
            bytes_received=status.bytes,
            transfers_done=1,
            seconds_total=receiver.metrics.seconds_total,
        )
        assert rogue("metrics").bytes_sent == 0
        # And after: the rogue again, then the legitimate sender on a new request.
        with pytest.raises(HandshakeError, match=auth.FAILED):
            rogue("connect", receiver.address)
        again = receiver.expect("again", side.pool.allocate(1), lease_s=30)
        assert legit.send(again, src_ids[:1], first_token=6).result(20).state is (
            TransferState.DONE
        )
    finally:
        rogue.stop()
        legit.close()


@pytest.mark.parametrize(
    ("sender_secret", "receiver_secret", "message"),
    [
        (SECRET, None, "the prefill worker has a KV secret, the decode worker has none"),
        (None, SECRET, "the decode worker requires a KV secret, the prefill worker has none"),
    ],
    ids=["receiver-without", "sender-without"],
)
def test_a_missing_secret_on_either_side_is_named(sender_secret, receiver_secret, message) -> None:
    side = make_side(4)
    receiver = make_receiver("ucx", side.kv, fingerprint(), secret=receiver_secret)
    sender = make_sender("ucx", make_side(4).kv, fingerprint(), secret=sender_secret)
    try:
        with pytest.raises(HandshakeError, match=message):
            sender.connect(receiver.address)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("kind", ["forged", "relayed"])
def test_an_impostor_receiver_gets_no_kv(decode, kind: str) -> None:
    # "forged": a listener without the secret makes up a proof. "relayed": it passes
    # the sender's HELLO to the real receiver and the real proof back; that proof
    # covers the real receiver's address, not the one the sender dialled.
    _, receiver, _ = decode

    async def forge(hello: bytes) -> bytes:
        return wire.encode_reply("", auth.new_nonce(), auth.proof(WRONG, auth.RECEIVER, hello))

    async def relay(hello: bytes) -> bytes:
        ep = await ucx_raw.connect(receiver.address)
        await wire.send_msg(ep, hello)
        return await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT)

    impostor = ucx_raw.run(ucx_raw.Impostor.start(forge if kind == "forged" else relay))
    prefill = make_side(8, seed=SEED)
    sender = make_sender("ucx", prefill.kv, fingerprint(), secret=SECRET)
    try:
        dest = receiver.expect("r", [0, 1], lease_s=30)
        dest = type(dest)(impostor.address, dest.request_id, dest.block_ids)
        sender.send_layers(dest, [0, 1], (0, 2))
        with pytest.raises(HandshakeError, match=f"{auth.FAILED}: the receiver at"):
            sender.send(dest, [0, 1], first_token=1).result(timeout=20)
        ucx_raw.run(impostor.done.wait())
        assert len(impostor.hellos) == 1
        assert impostor.received == []  # no proof, no K frame, no payload byte
        assert sender.metrics.bytes_sent == 0
    finally:
        sender.close()
        ucx_raw.run(_close(impostor))


async def _close(impostor) -> None:
    impostor.close()


def _k_frame(rid: str, dst_ids, seed: int = 3):
    """A header for blocks 0.. of a fresh source cache, and that cache's UCX memory."""
    src = make_side(8, seed=seed).kv
    n = len(dst_ids)
    header = make_header(rid, (0, 2), tuple(range(n)), tuple(dst_ids), src)
    return header, CacheMemory(src)


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        ("k-frame-first", "bad hello"),
        ("huge-size-first", f"message of {1 << 40} bytes over the limit"),
        ("wrong-proof", auth.FAILED),
    ],
)
def test_a_raw_peer_that_skips_or_fails_the_handshake_is_dropped(
    decode, caplog, kind: str, refusal: str
) -> None:
    side, receiver, before = decode
    dst_ids = side.pool.allocate(2)
    receiver.expect("r", dst_ids, lease_s=30)
    header, cache = _k_frame("r", dst_ids)

    async def attack() -> str:
        ep = await ucx_raw.connect(receiver.address)
        if kind == "wrong-proof":
            answer = await ucx_raw.handshake(
                ep, fingerprint(), receiver.address, proof=bytes(auth.PROOF_BYTES)
            )
        else:
            if kind == "k-frame-first":
                await ucx_raw.send_frame(ep, header)
            else:  # a 1 TiB "HELLO": refused before anything is allocated for it
                await ucx_raw.send_size(ep, 1 << 40)
            answer = wire.decode_reply(await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))
        try:  # the frames, (again) regardless, unless the receiver has hung up already
            await ucx_raw.send_cache(ep, cache)
            await ucx_raw.send_frame(ep, header)
        except Exception:
            pass
        ep.abort()
        return answer.error

    assert refusal in ucx_raw.run(attack())
    pattern = REFUSAL if kind == "wrong-proof" else re.compile(r"refused a sender at 127\.0\.0\.1")
    _wait_for_log(caplog, pattern)
    deadline = time.monotonic() + 10
    while receiver._connections:  # dropped: nothing more can arrive
        assert time.monotonic() < deadline, "the receiver kept the connection"
        time.sleep(0.01)
    assert receiver.poll("r").state is TransferState.WAITING
    assert _untouched(side.kv, before)
    assert receiver.metrics == TransferMetrics()
    cache.close()


def test_a_strangers_hello_can_neither_forge_nor_flood_the_log(decode, caplog) -> None:
    # A refusal is logged before the secret is checked, with the HELLO's values: a
    # model name of newlines and 60 KB forged whole lines, one per connection.
    import dataclasses

    _, receiver, _ = decode
    forged = dataclasses.replace(fingerprint(), model="x\nFORGED \x1b[2K" + "A" * 60_000)

    async def attack() -> None:
        for _ in range(5):
            ep = await ucx_raw.connect(receiver.address)
            assert "model" in (await ucx_raw.handshake(ep, forged, receiver.address)).error
            ep.abort()

    ucx_raw.run(attack())
    line = _wait_for_log(caplog, re.compile(r"refused a sender at 127\.0\.0\.1"))
    assert "\n" not in line and "\x1b" not in line and "x\\nFORGED \\x1b[2K" in line
    assert len(line) < 1000 and "characters)" in line
    refusals = [r for r in caplog.records if "refused a sender" in r.getMessage()]
    assert len(refusals) == 1  # the next four: held, counted with the next line logged


def test_the_right_secret_over_a_raw_client_is_accepted(decode) -> None:
    # The counterpart of the cases above: the same raw client, with the right proof,
    # gets its frame written (so those tests fail for the reason they claim).
    side, receiver, _ = decode
    dst_ids = side.pool.allocate(2)
    receiver.expect("r", dst_ids, lease_s=30)
    header, cache = _k_frame("r", dst_ids)

    async def client():
        ep = await ucx_raw.connect(receiver.address)
        reply = await ucx_raw.handshake(ep, fingerprint(), receiver.address, secret=SECRET)
        await ucx_raw.send_cache(ep, cache)
        await ucx_raw.send_frame(ep, header)
        return ep, reply

    ep, reply = ucx_raw.run(client())
    assert reply.error == ""
    deadline = time.monotonic() + 10
    while receiver.poll("r").bytes == 0:  # counted once verified and written
        assert time.monotonic() < deadline, "the authenticated frame never arrived"
        time.sleep(0.01)
    assert torch.equal(side.kv[:2, :, dst_ids], cache.kv[:2, :, :2])
    ep.abort()
    cache.close()


def test_peers_that_connect_and_stay_silent_cannot_crowd_out_a_sender(decode, monkeypatch):
    # Each silent peer holds its slot until handshake_timeout_s; past the bound a new
    # connection is dropped at once, and a slot freed is a slot a sender can use.
    from tandem.kv_transfer.ucx import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "MAX_HANDSHAKING", 2)
    _, receiver, _ = decode

    async def scenario():
        silent = [await ucx_raw.connect(receiver.address) for _ in range(2)]
        deadline = time.monotonic() + 10
        while receiver._handshaking < 2:
            assert time.monotonic() < deadline, "the silent peers never reached the receiver"
            await asyncio.sleep(0.01)
        crowded = await ucx_raw.connect(receiver.address)
        with pytest.raises(Exception, match="Connection reset|Request canceled"):  # ucxx's
            await asyncio.wait_for(
                ucx_raw.handshake(crowded, fingerprint(), receiver.address, secret=SECRET), 10
            )
        crowded.abort()
        silent.pop().abort()
        while receiver._handshaking > 1:
            assert time.monotonic() < deadline, "the silent peer's slot was never freed"
            await asyncio.sleep(0.01)
        sender = await ucx_raw.connect(receiver.address)
        reply = await ucx_raw.handshake(sender, fingerprint(), receiver.address, secret=SECRET)
        for ep in (*silent, sender):
            ep.abort()
        return reply

    assert ucx_raw.run(scenario(), timeout=30).error == ""
