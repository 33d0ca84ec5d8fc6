"""The UCX connection protocol: what travels on one endpoint, in order.

    sender -> receiver   HELLO    fingerprint, nonce_s, whether the sender has a secret
    receiver -> sender   REPLY    refused: the named mismatch (fingerprint, or which side
                                  has no secret), then both close; accepted: nonce_r and,
                                  with a secret, proof_r (see auth.py)
    with a secret only:
    sender -> receiver   PROOF    proof_s, sent only if proof_r was right
    receiver -> sender   VERDICT  accepted, or "KV authentication failed" (then both close)
    sender -> receiver   transport "nixl" (in the fingerprint) only: the first frame
                           b"M" + where the sender's cache lies (nixl.NixlKV.describe)
    sender -> receiver   then any number of frames, each one ``send_obj`` message:
                           b"K" + header (payload.encode_header), then, if header.nbytes,
                                  the payload as one tagged message of exactly nbytes
                                  (with "nixl": no payload; the receiver reads it)
                           b"A" + request id: the sender aborted that request
    receiver -> sender   ACK      one per final message: request id, state, reason, detail

No frame is read before the handshake has succeeded. Every message is read with
``recv_msg``, which refuses a size over its limit before allocating: a peer, even
an unauthenticated one, cannot make the other side allocate what it announces.

A header and its payload are written back to back by the connection's single
writer, so frames never interleave. Every message rides one UCX endpoint, whose
tag stream keeps them in order.
"""

from __future__ import annotations

import array
import json
from typing import NamedTuple

import torch

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint, TransferState, TransferStatus

KV_FRAME = b"K"
ABORT_FRAME = b"A"
NIXL_FRAME = b"M"
# Bounds on messages other than payloads (payloads: ReceiverCore.payload_limit).
HANDSHAKE_LIMIT = 64 << 10
ACK_LIMIT = 1 << 20


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


async def recv_msg(ep, limit: int) -> bytes:
    """One message sent with ``send_obj``; ProtocolError if it is over ``limit`` bytes.

    ``ep.recv_obj`` allocates whatever size the peer announces; this reads the size
    first and allocates only what passes.
    """
    size = array.array("Q", [0])
    await ep.recv(size)
    if size[0] > limit:
        raise ProtocolError(f"message of {size[0]} bytes over the limit of {limit}")
    body = bytearray(size[0])
    await ep.recv(body)
    return bytes(body)


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


def encode_ack(request_id: str, status: TransferStatus) -> bytes:
    return json.dumps([request_id, status.state.value, status.reason, status.detail]).encode()


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


def wire_buffer(t: torch.Tensor) -> object:
    """What ucxx sends from / receives into: the tensor's bytes, no copy.

    Host tensors go through numpy's array interface (as uint8, which also covers
    bfloat16); CUDA tensors expose __cuda_array_interface__ themselves.
    """
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()
