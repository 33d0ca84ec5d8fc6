"""The receiving half shared by every backend: reservations and their state machine.

A request's path on the decode side:

    engine thread                            transport thread (UCX loop or an in-process sender)
    expect(rid, block_ids, lease_s)
      -> Destination, state WAITING
                                             handshake(peer fingerprint) -> '' or mismatch text,
                                             then the shared secret proved (auth.py)
                                             deliver(header, payload | fill, source):
                                               header checked against the reservation
                                               under its write lock, only if still live:
                                                 ``fill`` reads the header's blocks out of
                                                 the sender's cache into the reserved ones
                                                 (ucx/rma.py; inproc.py in one process),
                                                 verified where they landed
                                             state TRANSFERRING; on the final message
                                             (every layer verified) DONE, else FAILED
    renew(rid, lease_s)                      the owner still waits: the lease runs on
    poll(rid) -> TransferStatus              (a lease past its deadline: FAILED "lease expired")
    release(rid)                             the caller then frees or keeps the blocks

Every write into a reservation's blocks happens in ``deliver``, under that
reservation's write lock, after re-checking that it is live; every path that
fails a reservation (abort, lease expiry, peer lost, close) waits for that lock
before returning to the caller. So once ``abort``/``poll``/``release`` has
reported a request failed, nothing more lands in its blocks, and the caller may
hand them to another request at once. Bytes that fail their checksum are never
decoded: the request fails "checksum".

Data for an unknown, released, aborted or expired request is discarded here
(nothing is read). A final message for a request released after it failed is
answered with why it failed (the owner gave it up, its lease expired), not as an
unknown request: the sender counts no failure for the first, and names the second.
The first sender to feed a reservation owns it: another sender's messages for it
(a router that retried prefill on another worker) are discarded, and its final
message is answered FAILED "another sender", never "done", so that two prefill
workers can never both report the first token of one request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.kv_transfer.base import (
    GIVEN_UP,
    Destination,
    Fingerprint,
    KVReceiver,
    TransferError,
    TransferMetrics,
    TransferState,
    TransferStatus,
)
from tandem.kv_transfer.heads import HeadMap
from tandem.kv_transfer.payload import (
    HeaderError,
    MessageHeader,
    check_fits,
    checksum_blocks,
)

# Copies a message's blocks into the reservation; returns their checksum if it took
# one on the way (payload.checksum_blocks of the destination), else None.
Fill = Callable[[], int | None]
log = logging.getLogger(__name__)

TERMINAL = (TransferState.DONE, TransferState.FAILED)


@dataclass(eq=False)
class _Reservation:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # clock() time after which an unfinished transfer fails
    num_layers: int
    state: TransferState = TransferState.WAITING
    reason: str = ""
    detail: str = ""
    claimed: list[bool] = field(default_factory=list)  # a message for layer i was accepted
    written: list[bool] = field(default_factory=list)  # layer i verified and in the blocks
    num_src_blocks: int | None = None  # fixed by the first message
    first_token: int | None = None
    nbytes: int = 0
    started: float | None = None
    seconds: float = 0.0
    source: object | None = None  # the connection that feeds it (for peer loss)
    # Held for the whole of a read into the blocks; failing paths take it to drain them.
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.claimed = [False] * self.num_layers
        self.written = [False] * self.num_layers

    def status(self) -> TransferStatus:
        return TransferStatus(
            state=self.state,
            reason=self.reason,
            first_token=self.first_token if self.state is TransferState.DONE else None,
            bytes=self.nbytes,
            seconds=self.seconds,
            detail=self.detail,
        )


UNKNOWN = "unknown request"


def _reference(source: object) -> Callable[[], object]:
    """A weak reference to ``source`` where it takes one, else a strong one."""
    try:
        return weakref.ref(source)
    except TypeError:  # plain values (a test's names)
        return lambda: source


# How many released requests' reasons a receiver remembers (for their late messages).
RELEASED_KEPT = 4096


class ReceiverCore:
    """Reservations of one decode worker's KV tensor; thread-safe."""

    def __init__(
        self,
        kv: torch.Tensor,  # [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]
        fingerprint: Fingerprint,
        address: str,
        metrics: TransferMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_request_blocks: int | None = None,
    ) -> None:
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, blocks + 1, ...], got {list(kv.shape)}")
        num_blocks = kv.shape[2] - 1
        if max_request_blocks is not None and max_request_blocks < 1:
            raise ValueError(f"max_request_blocks must be >= 1, got {max_request_blocks}")
        self.kv = kv
        self.fingerprint = fingerprint
        self.address = address
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.clock = clock
        # The largest reservation ``expect`` accepts (more than the pool is meaningless).
        self.max_request_blocks = min(max_request_blocks or num_blocks, num_blocks)
        # K and V of one layer of one block, in bytes.
        self.block_layer_bytes = 2 * kv[0, 0, 0].numel() * kv.element_size()
        self._lock = threading.Lock()  # guards _table and every reservation's fields
        self._table: dict[str, _Reservation] = {}
        # Requests released after they failed -> why, and a reference to the sender that
        # fed them, if one did (weak where it can be: a closed connection is not kept
        # alive for it); oldest first, RELEASED_KEPT of them.
        self._released: collections.OrderedDict[str, tuple[str, Callable[[], object] | None]] = (
            collections.OrderedDict()
        )
        # Called (under _lock) whenever a reservation ends: KVReceiver.notify.
        self.on_end: Callable[[], None] | None = None

    # --- engine side ---------------------------------------------------------------

    def expect(self, request_id: str, block_ids: Sequence[int], lease_s: float) -> Destination:
        """Reserve ``block_ids`` (already allocated by the caller) for ``request_id``."""
        num_blocks = self.kv.shape[2] - 1
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside the pool of {num_blocks} blocks")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block ids repeat")
        if len(block_ids) > self.max_request_blocks:
            raise ValueError(
                f"{len(block_ids)} blocks, more than max_request_blocks {self.max_request_blocks}"
            )
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        with self._lock:
            if request_id in self._table:
                raise ValueError(f"request {request_id!r} is already expected; release it first")
            self._released.pop(request_id, None)
            self._table[request_id] = _Reservation(
                request_id=request_id,
                block_ids=tuple(block_ids),
                deadline=self.clock() + lease_s,
                num_layers=self.kv.shape[0],
            )
        return Destination(self.address, request_id, tuple(block_ids))

    def poll(self, request_id: str, drain: bool = True) -> TransferStatus:
        with self._lock:
            res = self._table.get(request_id)
            if res is None:
                raise KeyError(f"request {request_id!r} is not expected")
            self._expire_locked(res)
            failed = res.state is TransferState.FAILED
        if failed and drain:
            # Whatever failed it (lease, checksum, abort), a copy that was already running
            # finishes before the caller learns, so it may free the blocks at once.
            self._drain(res)
        return res.status()

    def renew(self, request_id: str, lease_s: float) -> bool:
        with self._lock:
            res = self._table.get(request_id)
            if res is None or self._expire_locked(res) or res.state in TERMINAL:
                return False
            res.deadline = max(res.deadline, self.clock() + lease_s)
            return True

    def abort(self, request_id: str, reason: str = GIVEN_UP) -> None:
        """Fail a live reservation; on return no more data is written into its blocks.
        Its owner gave it up: no transfer failure is counted."""
        with self._lock:
            res = self._table.get(request_id)
            if res is None:
                return
            self._fail_locked(res, reason, failure=False)
        self._drain(res)

    def release(self, request_id: str, wait: bool = True) -> bool:
        """Forget a request (aborting it first if still live); its late data is discarded.
        See KVReceiver.release for ``wait``."""
        with self._lock:
            res = self._table.get(request_id)
            if res is None:
                return True
            self._fail_locked(res, GIVEN_UP, failure=False)  # its owner's doing
        if wait:
            self._drain(res)
        elif res.write_lock.acquire(blocking=False):  # no read is running into the blocks
            res.write_lock.release()
        else:
            return False
        with self._lock:
            if self._table.get(request_id) is res:
                del self._table[request_id]
                if res.state is TransferState.FAILED:
                    fed_by = None if res.source is None else _reference(res.source)
                    self._released[request_id] = (res.reason, fed_by)
                    if len(self._released) > RELEASED_KEPT:
                        self._released.popitem(last=False)
        return True

    def sweep(self) -> list[str]:
        """Expire every lease past its deadline; returns the ids it failed. It does not
        wait for reads into their blocks: ``poll`` and ``release`` do that for their
        owner, and a read from a sender that stopped answering (a frozen process: a
        UCX read ends only when it lands or its endpoint fails) would hold the sweep,
        and with it the expiry of every other lease."""
        with self._lock:
            expired = [r for r in self._table.values() if self._expire_locked(r)]
        return [r.request_id for r in expired]

    def close(self) -> None:
        with self._lock:
            live = [r for r in self._table.values() if r.state not in TERMINAL]
            for res in live:
                self._fail_locked(res, "receiver closed")
        for res in live:
            self._drain(res)

    @property
    def num_live(self) -> int:
        with self._lock:
            return sum(1 for r in self._table.values() if r.state not in TERMINAL)

    # --- transport side ------------------------------------------------------------

    def handshake(self, peer: Fingerprint) -> str:
        """'' if a sender with ``peer`` may connect, else the named differences."""
        problem = peer.mismatches(self.fingerprint, mine="prefill", theirs="decode")
        mine = self.fingerprint
        if problem or peer.tensor_parallel_size == mine.tensor_parallel_size:
            return problem
        # Heads re-split into this cache: it must be the ranks' layers it says it is.
        want = mine.tensor_parallel_size * mine.num_layers
        if self.kv.shape[0] != want:
            return (
                f"this receiver's KV tensor holds {self.kv.shape[0]} layers, not "
                f"tensor_parallel_size x num_layers = {want}: it cannot take another width"
            )
        return ""

    def deliver(
        self,
        header: MessageHeader,
        source: object = None,
        fill: Fill | None = None,
        heads: HeadMap | None = None,
    ) -> TransferStatus | None:
        """Take one received message; returns the request's status if ``header.final``.

        ``fill`` (needed when the header names blocks) reads them in place: called
        under the reservation's write lock once it is known live, it copies the
        header's source blocks into its destination blocks (TransferError if it
        cannot) and returns the checksum of what it wrote if it took one as it copied,
        else None, and the blocks are checksummed where they landed. The returned
        status is what the sender is told (its ack).

        ``heads``: the sender is of another tensor-parallel width (``Fingerprint.
        head_map``): its layers are counted, and ``fill`` re-splits the heads of the
        ones this side reads (heads.py); it is not called for a rank whose heads are
        read from another.
        """
        if header.nbytes and fill is None:
            raise ValueError("a message with KV needs a fill")
        with self._lock:
            res = self._table.get(header.request_id)
            foreign = res is not None and res.source not in (None, source)
            if res is not None and not foreign:
                if self._expire_locked(res):
                    # Lease ran out while nobody polled: drain below, then discard.
                    pass
                elif res.state not in TERMINAL:
                    problem = self._check_header(res, header, heads)
                    if problem:
                        self._fail_locked(res, "bad header", problem)
                    else:
                        res.source = source
                        if res.state is TransferState.WAITING:
                            res.state = TransferState.TRANSFERRING
                            res.started = self.clock()
            live = not foreign and res is not None and res.state is TransferState.TRANSFERRING
        if foreign:
            # The first sender owns the reservation until it ends: a second one (a router
            # retrying prefill elsewhere) must neither disturb it nor be told "done".
            return self._discard(header, None, "another sender", "fed by another sender")
        if not live:
            return self._discard(header, res, source=source)

        # The header fits (checked above): nothing to read, or another sender rank's
        # copy of these heads is read instead.
        if not header.nbytes or (
            heads is not None and not heads.reads(heads.rank_of(header.layer_start)[0])
        ):
            fill = None
        with res.write_lock:
            with self._lock:
                self._expire_locked(res)
                if res.state is not TransferState.TRANSFERRING:  # aborted or expired meanwhile
                    live = False
            if not live:
                return self._discard(header, res)
            if fill is not None:
                problem = self._fill(header, fill)
                if problem is not None:
                    with self._lock:
                        self._fail_locked(res, *problem)
                    return res.status() if header.final else None
            with self._lock:
                self._arrived_locked(res, header, header.nbytes if fill is not None else 0)
        return res.status() if header.final else None

    def _fill(self, header: MessageHeader, fill: Fill) -> tuple[str, str] | None:
        """Run ``fill`` and verify what landed; (reason, detail) when either fails."""
        layers = (header.layer_start, header.layer_end)
        try:
            digest = fill()
        except TransferError as exc:
            return exc.reason, str(exc)
        except Exception as exc:  # a read that broke: the request fails, the reader goes on
            log.exception("KV read of %s failed", header.request_id)
            return "read failed", repr(exc)
        if digest is None:
            digest = checksum_blocks(self.kv, header.dst_block_ids, layers)
        if digest != header.checksum:
            return "checksum", f"layers [{layers[0]}, {layers[1]})"
        return None

    def sender_abort(self, request_id: str, source: object) -> None:
        """The sender gave up on a request: fail it if this sender is feeding it. Its
        owner there gave it up (its call ended): not counted as a failure here either.
        A sender that fed nothing concerns no one here: its abort may be late (a prefill
        retried on another worker shares the reservation), and the reservation's own
        owner ends it otherwise."""
        with self._lock:
            res = self._table.get(request_id)
            if res is None or res.source is not source:
                return
            self._fail_locked(res, "aborted by sender", failure=False)
        self._drain(res)

    def source_lost(self, source: object) -> list[str]:
        """A connection died: fail every live request it was feeding."""
        with self._lock:
            lost = [
                r for r in self._table.values() if r.source is source and r.state not in TERMINAL
            ]
            for res in lost:
                self._fail_locked(res, "peer lost")
        for res in lost:
            self._drain(res)
        return [r.request_id for r in lost]

    # --- internals (``_locked``: caller holds self._lock) --------------------------

    def _check_header(self, res: _Reservation, h: MessageHeader, heads: HeadMap | None) -> str:
        sender = None if heads is None else (heads.src_layers, heads.num_layers, heads.src_heads)
        try:
            check_fits(h, self.kv, sender)
        except HeaderError as exc:
            return str(exc)
        n = len(h.dst_block_ids)
        if res.num_src_blocks is not None and n != res.num_src_blocks:
            return f"{n} blocks, earlier messages carried {res.num_src_blocks}"
        if h.dst_block_ids != res.block_ids[:n]:
            return "destination block ids differ from the reservation's"
        if res.num_src_blocks is None and heads is not None:
            # The first message: the sender's layers are what arrives (its ranks').
            res.claimed = [False] * heads.src_layers
            res.written = [False] * heads.src_layers
        if any(res.claimed[h.layer_start : h.layer_end]):
            return f"layers [{h.layer_start}, {h.layer_end}) arrived twice"
        res.num_src_blocks = n
        # Claimed before the payload is verified and written: a second message for the
        # same layers is refused even while this one is still being copied.
        res.claimed[h.layer_start : h.layer_end] = [True] * h.num_layers
        return ""

    def _arrived_locked(self, res: _Reservation, h: MessageHeader, nbytes: int) -> None:
        if res.state is not TransferState.TRANSFERRING:
            return  # failed (aborted, expired) while its last payload was being copied
        res.nbytes += nbytes
        res.written[h.layer_start : h.layer_end] = [True] * h.num_layers
        if not h.final:
            return
        missing = [i for i, ok in enumerate(res.written) if not ok]
        if missing:
            self._fail_locked(res, "incomplete", f"layers {missing} never arrived")
            return
        res.first_token = h.first_token
        res.state = TransferState.DONE
        res.seconds = self.clock() - (res.started or self.clock())
        self.metrics.record_done(res.seconds, received=res.nbytes)
        self._ended_locked()

    def _expire_locked(self, res: _Reservation) -> bool:
        if res.state not in TERMINAL and self.clock() > res.deadline:
            self._fail_locked(res, "lease expired")
            return True
        return False

    def _fail_locked(
        self, res: _Reservation, reason: str, detail: str = "", failure: bool = True
    ) -> None:
        """End a live reservation; ``failure`` False: its owner gave it up (a request
        that ended or was cancelled before its KV came), which is not counted."""
        if res.state in TERMINAL:
            return
        res.state = TransferState.FAILED
        res.reason = reason
        res.detail = detail
        if failure:
            self.metrics.record_failure(reason)
            log.warning("KV transfer %s failed: %s %s", res.request_id, reason, detail,
                        extra={"request_id": res.request_id})  # fmt: skip
        else:
            log.debug("KV transfer %s given up by its owner", res.request_id)
        self._ended_locked()

    def _ended_locked(self) -> None:
        if self.on_end is not None:
            try:
                self.on_end()
            except Exception:  # the owner still polls: a broken callback only slows it
                log.exception("KV receiver: the end-of-transfer callback failed")

    @staticmethod
    def _drain(res: _Reservation) -> None:
        # A read that passed its liveness check before the failure finishes first.
        with res.write_lock:
            pass

    def _discard(
        self,
        header: MessageHeader,
        res: _Reservation | None,
        reason: str = "",  # the answer when res is None ("": why it was released, if known)
        detail: str = "",
        source: object = None,  # the message's sender
    ) -> TransferStatus | None:
        with self._lock:
            self.metrics.messages_discarded += 1
            if res is None and not reason:
                reason, fed_by = self._released.get(header.request_id, (UNKNOWN, None))
                if fed_by is not None and fed_by() is not source:  # (gone: another one)
                    # Another sender fed it, and its end (it went away, or gave up)
                    # is no fault of this one's (a router's retry elsewhere).
                    reason = "another sender"
        if not header.final:
            return None
        if res is None:
            return TransferStatus(TransferState.FAILED, reason=reason, detail=detail)
        return res.status()


class CoreReceiver(KVReceiver):
    """A receiver whose engine-facing calls go straight to its ReceiverCore.

    Backends differ only in how bytes reach ``core.deliver``.
    """

    core: ReceiverCore

    @property
    def address(self) -> str:  # type: ignore[override]
        return self.core.address

    @property
    def metrics(self) -> TransferMetrics:  # type: ignore[override]
        return self.core.metrics

    def expect(self, request_id: str, block_ids: Sequence[int], lease_s: float) -> Destination:
        return self.core.expect(request_id, block_ids, lease_s)

    def poll(self, request_id: str, drain: bool = True) -> TransferStatus:
        return self.core.poll(request_id, drain)

    def renew(self, request_id: str, lease_s: float) -> bool:
        return self.core.renew(request_id, lease_s)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def release(self, request_id: str, wait: bool = True) -> bool:
        return self.core.release(request_id, wait)

    def notify(self, callback: Callable[[], None]) -> None:
        self.core.on_end = callback
