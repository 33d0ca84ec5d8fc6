"""The UCX connection protocol: what travels on one endpoint, in order.

    sender -> receiver   HELLO    fingerprint, nonce_s, whether the sender has a secret
    receiver -> sender   REPLY    refused: the named mismatch (fingerprint, or which side
                                  has no secret), then both close; accepted: nonce_r and,
                                  with a secret, proof_r (see auth.py)
    with a secret only:
    sender -> receiver   PROOF    proof_s, sent only if proof_r was right
    receiver -> sender   VERDICT  accepted, or "KV authentication failed" (then both close)
    sender -> receiver   the first frame: b"M" + where the sender's cache lies and the
                           key to read it (rma.CacheMemory.describe), and, on x86-64
                           Linux, the connection's mailbox (mailbox.py) on offer
    receiver -> sender   MAILBOX  only if one was offered: whether the receiver mapped
                                  it. If it did, every frame and ack below goes
                                  through the mailbox's rings instead of UCX
    sender -> receiver   then any number of frames, each one message (``send_msg``):
                           b"K" + header (payload.encode_header): the receiver reads the
                                  header's blocks out of the sender's cache (rma.py);
                                  no payload travels on the connection
                           b"A" + request id: the sender aborted that request
    receiver -> sender   ACK      one per final message: request id, state, reason, detail

No frame is read before the handshake has succeeded. Every message is one UCX tag
message, its length first (``send_msg``), received into a buffer of its kind's
limit (``recv_msg``): a peer, even an unauthenticated one, cannot make the other
side allocate what it announces.

Frames are written by the connection's single writer and ride one UCX endpoint,
whose tag stream keeps them in order.
"""

from __future__ import annotations

import asyncio
import collections
import json
import struct
from typing import NamedTuple

from ucxx.exceptions import UCXMessageTruncatedError

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint, TransferState, TransferStatus

KV_FRAME = b"K"
ABORT_FRAME = b"A"
CACHE_FRAME = b"M"
# Bounds on messages.
HANDSHAKE_LIMIT = 64 << 10
ACK_LIMIT = 64 << 10
_ACK_DETAIL_CHARS = 4096


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow; the connection is dropped."""


class Hello(NamedTuple):
    fingerprint: Fingerprint
    nonce: bytes  # nonce_s
    has_secret: bool


class Reply(NamedTuple):
    error: str  # '' if accepted
    nonce: bytes | None = None  # nonce_r (REPLY only)
    proof: bytes | None = None  # proof_r, when the receiver has a secret


_LENGTH = struct.Struct("<Q")


async def send_msg(ep, body: bytes) -> None:
    """One message: its length (8 bytes, little-endian) and the body, as one UCX tag
    message, so that the receiver has both after one completion (not two)."""
    await ep.send(_LENGTH.pack(len(body)) + body)


def inbox(limit: int) -> bytearray:
    """A receive buffer for messages of at most ``limit`` bytes (reuse it per reader)."""
    return bytearray(_LENGTH.size + limit)


async def recv_msg(ep, limit: int, buffer: bytearray | None = None) -> bytes:
    """One ``send_msg`` message of at most ``limit`` bytes; ProtocolError if it is over.

    It lands in ``buffer`` (``inbox(limit)``; a fresh one if None): the peer's message
    can never make this side allocate more. One longer than the buffer fails in UCX
    (truncated) and ends the connection; one whose length field says more than the
    limit is refused here.
    """
    if buffer is None:
        buffer = inbox(limit)
    try:
        await ep.recv(buffer)
    except UCXMessageTruncatedError:
        raise ProtocolError(f"message over the limit of {limit} bytes") from None
    (size,) = _LENGTH.unpack_from(buffer)
    if size > min(limit, len(buffer) - _LENGTH.size):
        raise ProtocolError(f"message of {size} bytes over the limit of {limit}")
    return bytes(buffer[_LENGTH.size : _LENGTH.size + size])


class Reader:
    """Reads one endpoint's messages with ``depth`` receives posted ahead, each into its
    own buffer: messages that arrive back to back complete together, instead of each
    waiting for the one before it to be taken (a notification round trip apiece).
    UCX matches one tag's receives in the order they were posted, so messages come out
    in the order they were sent. ``close`` cancels what is still posted."""

    def __init__(self, ep, limit: int, depth: int = 8) -> None:
        self.ep, self.limit = ep, limit
        self._posted: collections.deque[tuple[asyncio.Task, bytearray]] = collections.deque()
        for _ in range(depth):
            self._post(inbox(limit))

    def _post(self, buffer: bytearray) -> None:
        # A task's first step posts its receive; tasks start in the order they were made.
        self._posted.append((asyncio.ensure_future(recv_msg(self.ep, self.limit, buffer)), buffer))

    async def next(self) -> bytes:
        task, buffer = self._posted[0]
        message = await task  # a copy: the buffer is free again
        self._posted.popleft()
        self._post(buffer)
        return message

    def close(self) -> None:
        for task, _ in self._posted:
            task.cancel()
        self._posted.clear()


def _json(data: bytes, what: str) -> dict:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"bad {what}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"bad {what}: not a JSON object")
    return body


def _bytes(body: dict, key: str, size: int, what: str) -> bytes | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        raw = bytes.fromhex(value)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != size:
        raise ProtocolError(f"bad {what}: {key} must be {size} bytes in hex")
    return raw


def encode_hello(fp: Fingerprint, nonce: bytes, has_secret: bool) -> bytes:
    return json.dumps(
        {"fingerprint": fp.to_dict(), "nonce": nonce.hex(), "secret": has_secret}
    ).encode()


def decode_hello(data: bytes) -> Hello:
    """A peer of an older protocol sent its bare fingerprint: that still parses, so the
    reply can name the protocol versions instead of a parse error."""
    body = _json(data, "hello")
    try:
        fp = Fingerprint.from_dict(body.get("fingerprint", body))
    except (TypeError, AttributeError) as exc:
        raise ProtocolError(f"bad hello: {exc}") from None
    nonce = _bytes(body, "nonce", auth.NONCE_BYTES, "hello") or b""
    return Hello(fp, nonce, body.get("secret") is True)


def encode_reply(error: str, nonce: bytes | None = None, proof: bytes | None = None) -> bytes:
    """A REPLY (with ``nonce``) or a VERDICT (without)."""
    body = {"ok": not error, "error": error}
    if nonce is not None:
        body["nonce"] = nonce.hex()
    if proof is not None:
        body["proof"] = proof.hex()
    return json.dumps(body).encode()


def decode_reply(data: bytes) -> Reply:
    body = _json(data, "handshake reply")
    if body.get("ok") is not True:
        return Reply(str(body.get("error") or "refused without a reason"))
    return Reply(
        "",
        _bytes(body, "nonce", auth.NONCE_BYTES, "handshake reply"),
        _bytes(body, "proof", auth.PROOF_BYTES, "handshake reply"),
    )


def encode_proof(proof: bytes) -> bytes:
    return json.dumps({"proof": proof.hex()}).encode()


def decode_proof(data: bytes) -> bytes | None:
    return _bytes(_json(data, "proof"), "proof", auth.PROOF_BYTES, "proof")


def encode_mailbox_answer(taken: bool) -> bytes:
    return json.dumps({"mailbox": taken}).encode()


def decode_mailbox_answer(data: bytes) -> bool:
    taken = _json(data, "mailbox answer").get("mailbox")
    if not isinstance(taken, bool):
        raise ProtocolError("bad mailbox answer: no yes or no")
    return taken


def encode_ack(request_id: str, status: TransferStatus) -> bytes:
    detail = status.detail[:_ACK_DETAIL_CHARS]  # an ack stays well within ACK_LIMIT
    return json.dumps([request_id, status.state.value, status.reason, detail]).encode()


def decode_ack(data: bytes | bytearray) -> tuple[str, TransferStatus]:
    try:
        rid, state, reason, detail = json.loads(bytes(data))
        return rid, TransferStatus(TransferState(state), reason=reason, detail=detail)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"bad ack: {exc}") from None


def frame_limit(max_request_blocks: int) -> int:
    """Largest K/A frame a receiver reads: a header lists up to ``max_request_blocks``
    source and destination ids (at most 20 digits and a comma each), plus the rest."""
    return (64 << 10) + 2 * 21 * max_request_blocks
