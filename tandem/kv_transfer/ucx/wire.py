"""The UCX connection protocol: what travels on one endpoint, in order.

    sender -> receiver   HELLO   fingerprint (JSON)
    receiver -> sender   REPLY   '' (accepted) or the named mismatch; on mismatch both close
    sender -> receiver   then any number of frames, each one ``send_obj`` message:
                           b"K" + header (payload.encode_header), then, if header.nbytes,
                                  the payload as one tagged message of exactly nbytes
                           b"A" + request id: the sender aborted that request
    receiver -> sender   ACK     one per final message: request id, state, reason, detail

A header and its payload are written back to back by the connection's single
writer, so frames never interleave. Every message rides one UCX endpoint, whose
tag stream keeps them in order.
"""

from __future__ import annotations

import json

import torch

from tandem.kv_transfer.base import Fingerprint, TransferState, TransferStatus

KV_FRAME = b"K"
ABORT_FRAME = b"A"


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow; the connection is dropped."""


def encode_hello(fp: Fingerprint) -> bytes:
    return json.dumps(fp.to_dict()).encode()


def decode_hello(data: bytes | bytearray) -> Fingerprint:
    try:
        return Fingerprint.from_dict(json.loads(bytes(data)))
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"bad hello: {exc}") from None


def encode_reply(problem: str) -> bytes:
    return json.dumps({"ok": not problem, "error": problem}).encode()


def decode_reply(data: bytes | bytearray) -> str:
    """'' if the receiver accepted us, else its description of the mismatch."""
    try:
        body = json.loads(bytes(data))
        return "" if body["ok"] else str(body["error"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ProtocolError(f"bad handshake reply: {exc}") from None


def encode_ack(request_id: str, status: TransferStatus) -> bytes:
    return json.dumps([request_id, status.state.value, status.reason, status.detail]).encode()


def decode_ack(data: bytes | bytearray) -> tuple[str, TransferStatus]:
    try:
        rid, state, reason, detail = json.loads(bytes(data))
        return rid, TransferStatus(TransferState(state), reason=reason, detail=detail)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"bad ack: {exc}") from None


def wire_buffer(t: torch.Tensor) -> object:
    """What ucxx sends from / receives into: the tensor's bytes, no copy.

    Host tensors go through numpy's array interface (as uint8, which also covers
    bfloat16); CUDA tensors expose __cuda_array_interface__ themselves.
    """
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()
