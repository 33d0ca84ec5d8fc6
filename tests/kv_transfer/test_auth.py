"""The shared-secret handshake's parts: secrets, proofs, wire messages, the in-process check."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from tandem.kv_transfer import HandshakeError, TransferState, auth, make_receiver, make_sender
from tandem.kv_transfer.base import PROTOCOL_VERSION
from tandem.kv_transfer.ucx import wire
from tests.kv_transfer.conftest import fingerprint, make_side

SECRET = b"0123456789abcdef"  # the shortest allowed
NONCE_S, NONCE_R = b"s" * 32, b"r" * 32


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        (b"fifteen bytes!!", "secret must be at least 16 bytes, got 15"),
        ("a str of more than 16 chars", "secret must be bytes or None, got str"),
    ],
)
def test_a_weak_or_mistyped_secret_is_refused_at_construction(secret, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_sender("inproc", make_side(2).kv, fingerprint(), secret=secret)
    with pytest.raises(ValueError, match=message):
        make_receiver("inproc", make_side(2).kv, fingerprint(), secret=secret)


def test_a_proof_binds_role_secret_nonces_layout_and_address() -> None:
    t = auth.transcript(fingerprint(), NONCE_S, NONCE_R, "10.0.0.5:7000")
    good = auth.proof(SECRET, auth.RECEIVER, t)
    assert auth.verify(SECRET, auth.RECEIVER, t, good)
    assert not auth.verify(SECRET, auth.SENDER, t, good)  # one side's proof is not the other's
    assert not auth.verify(SECRET + b"x", auth.RECEIVER, t, good)
    assert not auth.verify(SECRET, auth.RECEIVER, t, None)
    for other in (
        auth.transcript(fingerprint(), NONCE_R, NONCE_S, "10.0.0.5:7000"),  # nonces swapped
        auth.transcript(fingerprint(), NONCE_S, b"x" * 32, "10.0.0.5:7000"),  # fresh nonce_r
        auth.transcript(fingerprint(block_size=32), NONCE_S, NONCE_R, "10.0.0.5:7000"),
        auth.transcript(fingerprint(), NONCE_S, NONCE_R, "10.0.0.6:7000"),  # a relay
    ):
        assert not auth.verify(SECRET, auth.RECEIVER, other, good)
    assert SECRET not in t and SECRET.hex().encode() not in t


def test_presence_mismatches_name_the_side_without_a_secret() -> None:
    assert auth.presence_problem(True, True) == auth.presence_problem(False, False) == ""
    assert "the decode worker has none" in auth.presence_problem(True, False)
    assert "the prefill worker has none" in auth.presence_problem(False, True)


@pytest.mark.parametrize(
    ("sender_secret", "receiver_secret", "problem"),
    [
        (SECRET, SECRET, None),
        (SECRET, SECRET[::-1], "KV authentication failed: the two workers' KV secrets differ"),
        (SECRET, None, "the decode worker has none"),
        (None, SECRET, "the prefill worker has none"),
    ],
    ids=["same", "different", "receiver-without", "sender-without"],
)
def test_inproc_compares_the_secrets(sender_secret, receiver_secret, problem) -> None:
    src, dst = make_side(4, seed=1), make_side(4)
    sender = make_sender("inproc", src.kv, fingerprint(), secret=sender_secret)
    receiver = make_receiver("inproc", dst.kv, fingerprint(), secret=receiver_secret)
    try:
        dest = receiver.expect("r", [0], lease_s=30)
        future = sender.send(dest, [0], first_token=1)
        if problem is None:
            assert future.result(5).state is TransferState.DONE
        else:
            with pytest.raises(HandshakeError, match=problem):
                future.result(5)
            assert receiver.poll("r").state is TransferState.WAITING
            assert not dst.kv.any()
    finally:
        sender.close()
        receiver.close()


def test_wire_handshake_messages_round_trip() -> None:
    hello = wire.decode_hello(wire.encode_hello(fingerprint(), NONCE_S, True))
    assert hello == wire.Hello(fingerprint(), NONCE_S, True)
    proof = auth.proof(SECRET, auth.RECEIVER, b"t")
    assert wire.decode_reply(wire.encode_reply("", NONCE_R, proof)) == wire.Reply(
        "", NONCE_R, proof
    )
    assert wire.decode_reply(wire.encode_reply("nope")) == wire.Reply("nope")
    assert wire.decode_proof(wire.encode_proof(proof)) == proof
    with pytest.raises(wire.ProtocolError, match="nonce must be 32 bytes"):
        wire.decode_hello(json.dumps({"fingerprint": fingerprint().to_dict(), "nonce": "ab"}))


def test_an_old_peers_hello_is_named_by_its_protocol_version() -> None:
    old = json.dumps(fingerprint(protocol=3).to_dict()).encode()  # version 3: bare fingerprint
    hello = wire.decode_hello(old)
    problem = hello.fingerprint.mismatches(fingerprint(), mine="prefill", theirs="decode")
    assert problem == f"protocol: prefill 3, decode {PROTOCOL_VERSION}"


class _FakeEndpoint:
    """Delivers one message of ``data``; records the size of every buffer it fills."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.buffers: list[int] = []

    async def recv(self, buf) -> None:
        self.buffers.append(len(buf))
        buf[: len(self.data)] = self.data


def test_recv_msg_refuses_an_oversized_message_without_allocating_for_it() -> None:
    ep = _FakeEndpoint(struct.pack("<Q", 1 << 40))  # announces 1 TiB
    with pytest.raises(wire.ProtocolError, match=f"message of {1 << 40} bytes over the limit"):
        asyncio.run(wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))
    assert ep.buffers == [8 + wire.HANDSHAKE_LIMIT]  # the limit's buffer, nothing more
    ep = _FakeEndpoint(struct.pack("<Q", 5) + b"hello")
    inbox = wire.inbox(5)
    assert asyncio.run(wire.recv_msg(ep, 5, inbox)) == b"hello"
    assert ep.buffers == [13]
