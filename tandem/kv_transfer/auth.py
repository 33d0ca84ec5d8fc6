"""Who may exchange KV: a per-cluster shared secret, proved by both sides, never sent.

A connection's handshake (ucx/wire.py carries it; the in-process backend compares
the two secrets directly):

    sender -> receiver   HELLO   fingerprint, nonce_s (32 fresh random bytes), has a secret?
    receiver             refuses a fingerprint mismatch, or a sender whose "has a secret"
                         differs from its own (the message says which side lacks one)
    receiver -> sender   REPLY   nonce_r (32 fresh random bytes), proof_r = HMAC(receiver, T)
    sender               proof_r wrong -> HandshakeError("KV authentication failed"):
                         not one byte of KV goes to a listener without the secret
    sender -> receiver   PROOF   proof_s = HMAC(sender, T)
    receiver             compare_digest(proof_s): wrong or missing -> refused and logged
                         with the peer's address, before any frame is read
    receiver -> sender   VERDICT ok, or the refusal

    T = the sender's fingerprint | nonce_s | nonce_r | the receiver's address
        ("host:port"), each field length-prefixed;
        HMAC(role, T) = HMAC-SHA256(secret, "tandem-kv <role>" NUL T)

The secret itself never travels. Fresh nonces on both sides make a recorded
transcript useless later, and the two role labels keep one side's proof from
passing as the other's. The receiver's address in T stops a relay: an impostor
listener that forwards a sender's HELLO to a real receiver gets a proof over the
real receiver's address, which the sender (who dialled the impostor's) rejects.

Authentication does not encrypt: see the package docstring.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from tandem.kv_transfer.base import Fingerprint

MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
RECEIVER, SENDER = "receiver", "sender"
FAILED = "KV authentication failed"


def check_secret(secret: bytes | None) -> bytes | None:
    """The secret as given, or ValueError naming the option and its limit."""
    if secret is None:
        return None
    if not isinstance(secret, bytes | bytearray):
        raise ValueError(f"secret must be bytes or None, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def transcript(fp: Fingerprint, nonce_s: bytes, nonce_r: bytes, address: str) -> bytes:
    """What both proofs cover: this connection's nonces, the sender's fingerprint as
    its HELLO carried it (the two sides' may differ in tensor-parallel width) and the
    receiver's address."""
    fields = (
        json.dumps(fp.to_dict(), sort_keys=True, separators=(",", ":")).encode(),
        nonce_s,
        nonce_r,
        address.encode(),
    )
    return b"".join(len(f).to_bytes(4, "big") + f for f in fields)


def proof(secret: bytes, role: str, t: bytes) -> bytes:
    return hmac.new(secret, b"tandem-kv " + role.encode() + b"\0" + t, hashlib.sha256).digest()


def verify(secret: bytes, role: str, t: bytes, got: bytes | None) -> bool:
    """Constant-time check of a peer's proof (None: it sent none)."""
    return got is not None and hmac.compare_digest(proof(secret, role, t), got)


def presence_problem(sender_has: bool, receiver_has: bool) -> str:
    """'' when both or neither side has a secret, else which side lacks one."""
    if sender_has == receiver_has:
        return ""
    if sender_has:
        return (
            f"{FAILED}: the prefill worker has a KV secret, the decode worker has none "
            "(set the same secret on both)"
        )
    return (
        f"{FAILED}: the decode worker requires a KV secret, the prefill worker has none "
        "(set the same secret on both)"
    )


def local_problem(sender_secret: bytes | None, receiver_secret: bytes | None) -> str:
    """The in-process check: same presence, and the same bytes."""
    problem = presence_problem(sender_secret is not None, receiver_secret is not None)
    if problem or sender_secret is None or receiver_secret is None:
        return problem
    if not hmac.compare_digest(sender_secret, receiver_secret):
        return f"{FAILED}: the two workers' KV secrets differ"
    return ""
