"""The KV transfer contract shared by every backend.

A prefill worker sends a request's KV blocks, plus the first sampled token, into
blocks that a decode worker reserved for that request; the decode side reads them
out of the prefill worker's cache, which holds them until the read is acked:

    decode worker                               prefill worker
    receiver.expect(request_id, block_ids, lease)
        -> Destination(address, request_id, block_ids)   (sent via the router)
                                                [sender.send_layers(destination, src, layers)]*
                                                sender.send(destination, src, first_token)
                                                    -> Future
    receiver: WAITING -> TRANSFERRING -> DONE | FAILED(reason)
                                                the future resolves once the receiver
                                                confirmed (then the prefill side frees
                                                its blocks) or raises TransferError(reason)

Every reservation has an owner and a deadline: a request whose data has not
fully arrived when its lease runs out is FAILED("lease expired"), and the caller
frees its blocks. Payloads carry a checksum; a mismatch is FAILED("checksum"),
never DONE. Connections start with a handshake: fingerprints compared (a mismatch
is an immediate error naming both values), then, when the workers have a shared
secret, each side proves it holds the secret (auth.py) before any KV moves.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kv_transfer.heads import HeadMap

# 2 let the final message carry ``extra`` bytes (a sampler RNG state); 3 drops them
# again, since seeded sampling no longer needs state from the prefill side; 4 makes
# the handshake a mutual challenge-response over a shared secret (HELLO carries a
# nonce, REPLY a nonce and a proof, then PROOF and VERDICT), which a version-3 peer
# cannot speak: the version mismatch is named instead of a parse error; 5 sends no
# payloads: after the handshake the sender describes its cache (frame b"M") and the
# receiver reads each header's blocks out of it (ucx/rma.py); 6 lets the two sides'
# tensor-parallel widths differ (the receiver re-splits heads, heads.py), which needs
# a sender that cuts its messages at rank boundaries; 7 may offer a mailbox in frame
# b"M", which the receiver answers, and then carries frames and acks through it
# (ucx/mailbox.py).
PROTOCOL_VERSION = 7
# The decode/prefill KV tensor layout this protocol moves (see tandem/engine/kv_cache.py).
KV_LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"
# How a host cache's blocks are checksummed (payload.py); a GPU cache's differ
# (device_checksum.py), and both sides must use the same.
HOST_CHECKSUM = "xxh3_64-layers"
LEGACY_HOST_CHECKSUM = "xxh3_64"  # what host caches used before: one xxh3_64 per message
# The reason a receiver's ack gives for a reservation that its owner gave up (the
# request ended on the decode side): not a transfer failure at either end.
GIVEN_UP = "aborted"
# The trailing metadata key of a Prefill call that ended ABORTED: its transfer's reason.
KV_FAILURE_KEY = "tandem-kv-failure"
# Reasons that say nothing about the link between the two workers: the decode side
# gave the request up or had released it, or another prefill worker feeds it (a retry
# after the first went away). The router puts the pair in cooldown for the others.
NOT_THE_LINK = frozenset({GIVEN_UP, "another sender", "unknown request"})


class TransferState(str, enum.Enum):
    WAITING = "waiting"  # reserved, nothing arrived yet
    TRANSFERRING = "transferring"  # some layers arrived
    DONE = "done"  # every layer arrived and verified
    FAILED = "failed"


class TransferError(Exception):
    """A transfer could not complete; ``reason`` is a short machine-readable cause."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or reason)
        self.reason = reason

    def __reduce__(self):  # keep ``reason`` across processes (pickle)
        return (TransferError, (self.reason, str(self)))


class HandshakeError(TransferError):
    """The two sides cannot exchange KV: the message names each differing setting."""

    def __init__(self, message: str) -> None:
        super().__init__("handshake", message)

    def __reduce__(self):
        return (HandshakeError, (str(self),))


@dataclass(frozen=True)
class Fingerprint:
    """Everything both sides must agree on for KV bytes to mean the same thing."""

    model: str  # model identity: name plus a hash of its config
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str = KV_LAYOUT
    protocol: int = PROTOCOL_VERSION
    checksum: str = HOST_CHECKSUM  # device_checksum.algorithm_for(the cache's device)
    # The setting: auto (the model's dtype) or int8 (values and scales); a peer that
    # predates the field sends none, and its cache is the model's dtype.
    kv_cache_dtype: str = "auto"
    # What an int8 cache's K rows are scaled by before quantization (tandem/engine/
    # k_balance.py names it); "none" for a float cache, and from a peer that predates
    # the field, whose int8 K rows are stored unscaled.
    kv_scaling: str = "none"
    # A tensor-parallel worker's host cache holds every rank's heads, rank by rank
    # (tandem/engine/parallel.py); widths may differ, the receiver re-splits the heads
    # (heads.py). A peer predating the field is of width 1.
    tensor_parallel_size: int = 1

    def mismatches(self, other: Fingerprint, mine: str = "prefill", theirs: str = "decode") -> str:
        """'' if compatible, else e.g. 'block_size: prefill 16, decode 32; dtype: ...'.

        The widths may differ, if each splits the model's KV heads. A layout other
        than ``KV_LAYOUT`` (a tensor-parallel cache that is not all in one place: "not
        transferable") is named even when both sides have it."""
        from tandem.kv_transfer.heads import width_problem

        diffs = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "tensor_parallel_size":
                why = width_problem(a, self.num_kv_heads) or width_problem(b, other.num_kv_heads)
                if why:
                    diffs.append(f"{f.name}: {mine} {a!r}, {theirs} {b!r} ({why})")
            elif a != b or (f.name == "kv_layout" and a != KV_LAYOUT):
                diffs.append(f"{f.name}: {mine} {a}, {theirs} {b}")
                if f.name == "dtype":  # dtype auto resolves per CPU (native bf16 or not)
                    diffs[-1] += " (set engine.dtype where the workers' CPUs differ)"
        return "; ".join(diffs)

    def head_map(self, sender: Fingerprint) -> HeadMap | None:
        """How a compatible ``sender``'s ranks feed this side's (None: the same width)."""
        if sender.tensor_parallel_size == self.tensor_parallel_size:
            return None
        from tandem.kv_transfer.heads import head_map

        return head_map(
            self.num_layers,
            self.num_kv_heads,
            sender.tensor_parallel_size,
            self.tensor_parallel_size,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        # A peer that predates the checksum field hashed host caches with plain xxh3_64
        # over the whole message: named, so that a mismatch is refused by name.
        d = {"checksum": LEGACY_HOST_CHECKSUM, **d}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class Destination:
    """Where a request's KV must go: handed by the decode worker to the prefill worker."""

    address: str  # the receiver's listener, "host:port" (or an in-process name)
    request_id: str
    block_ids: tuple[int, ...]  # filled in order by the source's blocks after skip_blocks
    # The first blocks of the prompt the receiver already holds (its prefix cache): the
    # sender sends its blocks from this index on.
    skip_blocks: int = 0


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""  # why it failed
    first_token: int | None = None  # arrives with the KV
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""  # for people: which layers, which setting


@dataclass
class TransferMetrics:
    """Counters a worker exports to Prometheus."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_done: int = 0
    seconds_total: float = 0.0
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_discarded: int = 0  # data that arrived for an unknown or finished request
    # Called with each completed transfer's seconds (the worker's histogram).
    on_done: Callable[[float], None] | None = None

    def record_done(self, seconds: float, sent: int = 0, received: int = 0) -> None:
        self.transfers_done += 1
        self.bytes_sent += sent
        self.bytes_received += received
        self.seconds_total += seconds
        if self.on_done is not None:
            self.on_done(seconds)

    def record_failure(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1


class KVSender(abc.ABC):
    """The prefill side. One instance per worker; connects once per receiver and reuses it."""

    metrics: TransferMetrics

    @abc.abstractmethod
    def send_layers(
        self, destination: Destination, src_block_ids: Sequence[int], layers: tuple[int, int]
    ) -> None:
        """Push layers [start, end) now (e.g. as prefill finishes them); no confirmation.

        The receiver reads the blocks in place: they must not change until the final
        ``send``'s future is done; failures surface in that future.
        """

    @abc.abstractmethod
    def send(
        self,
        destination: Destination,
        src_block_ids: Sequence[int],
        first_token: int,
        layers: tuple[int, int] | None = None,
    ) -> Future[TransferStatus]:
        """Push the request's remaining layers (or ``layers``) and the first token.

        The future resolves to a DONE status once the receiver verified every layer,
        or raises TransferError(reason). The blocks may change once it is done.
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop sending a request; its future fails with reason "aborted". The id stays
        refused (a late ``send_layers`` must not restart it) until ``forget``."""

    @abc.abstractmethod
    def forget(self, request_id: str) -> None:
        """A new request takes an aborted one's id: it may be sent again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail every unfinished request ("closed") and drop all connections."""


class KVReceiver(abc.ABC):
    """The decode side: reservations polled by the engine thread."""

    address: str
    metrics: TransferMetrics

    @abc.abstractmethod
    def expect(self, request_id: str, block_ids: Sequence[int], lease_s: float) -> Destination:
        """Reserve already-allocated blocks for a request; WAITING until data arrives."""

    @abc.abstractmethod
    def poll(self, request_id: str, drain: bool = True) -> TransferStatus:
        """Where the request's KV stands. A FAILED one is drained first (a read already
        running into its blocks finishes), unless ``drain`` is False: then the caller
        frees the blocks only after ``release`` says it may."""

    @abc.abstractmethod
    def renew(self, request_id: str, lease_s: float) -> bool:
        """Push an unfinished request's lease to ``lease_s`` from now (its owner is still
        waiting for the KV); False when it is not live (unknown, done or failed)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Fail a live request; on return nothing more is written into its blocks."""

    @abc.abstractmethod
    def release(self, request_id: str, wait: bool = True) -> bool:
        """Forget a request (aborting it if still live); the caller owns its blocks again.
        With ``wait`` False, a read still running into its blocks (a slow or stalled
        peer) is not waited for: False, and the request is kept, failed, until a later
        call finds the read done. True otherwise."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def notify(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a reservation ends (DONE or FAILED), from the thread
        that ended it and under its locks: it must neither block nor call back in. The
        owner polls to learn which (the engine thread, woken by it)."""
