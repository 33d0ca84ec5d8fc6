"""Same-host control: a connection's frames and acks through rings in shared memory.

Between workers on one host the KV itself is read straight out of the sender's
mapped cache (rma.py); what is left on the connection is control, a header per
message and an ack per request. Through ucxx each of those crossed UCX's progress
thread, ucxx's notifier thread and the asyncio loop before the thread that acts on
it woke: about 2 ms of a 16 MiB request's 5 (bench/README.md). A mailbox is two
single-producer, single-consumer rings in one shared-memory segment, each with a
futex word its consumer sleeps on, so a message wakes the thread that acts on it
directly:

    frames   sender's UCX loop thread (the connection's writer) -> receiver's
             deliverer thread
    acks     receiver's deliverer thread -> sender's ack thread

The sender allocates the segment with UCX (as it allocates its cache) and offers it
in frame b"M"; a receiver that can map it (same host, ``map_peers``) says so, and
from then on every frame and ack of the connection goes through the mailbox. The
UCX endpoint stays: it carried the handshake, and its error handling still tells
each side at once that the other died (both then close the rings, which wakes
their threads). Elsewhere (another host, a segment that cannot be attached) the
connection carries its frames as UCX messages, as before.

A ring: a 64-byte head, then the data.

    0   u32 seq      bumped by the producer after each record (the consumer's futex)
    8   u64 head     bytes the producer has written, in all
    16  u64 tail     bytes the consumer has taken, in all
    24  u32 closed   either side ends the ring

A record is its length (u32) and its body, padded to 8 bytes; a record that would
straddle the end is preceded by a wrap marker and starts again at 0. Stores are
made in order (data, then head, then seq) and x86-64 keeps stores in order and
loads in order, so a consumer that sees a head sees the bytes before it: mailboxes
are offered on x86-64 Linux only. What a consumer reads was written by its peer,
so it is copied out before it is parsed and checked against the ring's bounds;
a bad record ends the connection (RingError), as a bad UCX frame does.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

from tandem.kv_transfer.ucx import ucp

# Ring sizes (data bytes). A frame is a header: block ids at about 42 bytes a block,
# so one of 4 MiB lists ~100k blocks; acks are at most ACK_LIMIT.
FRAME_RING_BYTES = 4 << 20
ACK_RING_BYTES = 256 << 10
_HEAD_BYTES = 64
_WRAP = 0xFFFFFFFF
_LEN = 4

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the peer is another process


def supported() -> bool:
    """Whether this process may offer or take a mailbox (see the module's docstring)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


class RingError(Exception):
    """The ring holds what its producer could not have written: the peer is broken."""


class RingClosed(Exception):
    """The ring was closed (by either side)."""


class _Head(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_uint32),
        ("_pad0", ctypes.c_uint32),
        ("head", ctypes.c_uint64),
        ("tail", ctypes.c_uint64),
        ("closed", ctypes.c_uint32),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at ``address`` is ``expected``, at most ``timeout_s`` (the
    GIL is released meanwhile); spurious returns are the caller's to handle."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ctypes.byref(ts),
        None,
        0,
    )


def _futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 1, None, None, 0)


def _padded(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One direction of a mailbox, at ``address`` (``Ring.nbytes(capacity)`` bytes,
    8-byte aligned, zeroed by whoever made it). One thread puts, one thread gets."""

    @staticmethod
    def nbytes(capacity: int) -> int:
        return _HEAD_BYTES + capacity

    def __init__(self, address: int, capacity: int) -> None:
        if address % 8 or capacity % 8 or capacity < 64:
            raise ValueError("a ring needs an 8-byte aligned address and capacity")
        self._h = _Head.from_address(address)
        self._seq_address = address
        self._data = address + _HEAD_BYTES
        self.capacity = capacity
        self.max_record = capacity - _LEN - 8  # fits, length and padding, from offset 0

    # --- producer ------------------------------------------------------------------

    def put(self, body: bytes) -> bool:
        """Append one record; False when the ring has no room for it now (the consumer
        is behind), RingClosed when it was closed. ValueError: it can never fit."""
        if len(body) > self.max_record:
            raise ValueError(f"a record of {len(body)} bytes, over the ring's {self.max_record}")
        h = self._h
        if h.closed:
            raise RingClosed()
        head, tail = h.head, h.tail
        if head % 8 or not 0 <= head - tail <= self.capacity:  # the peer wrote them
            raise RingError(f"ring positions out of bounds (head {head}, tail {tail})")
        at = head % self.capacity
        size = _padded(_LEN + len(body))
        if at + size > self.capacity:  # it would straddle the end: wrap first
            if head + (self.capacity - at) - tail > self.capacity:
                return False  # the consumer has not yet taken what lies up to the end
            ctypes.c_uint32.from_address(self._data + at).value = _WRAP
            head += self.capacity - at
            self._publish(head)  # so that the consumer frees the end of the ring
            at = 0
        if head + size - tail > self.capacity:
            return False
        ctypes.c_uint32.from_address(self._data + at).value = len(body)
        ctypes.memmove(self._data + at + _LEN, body, len(body))
        self._publish(head + size)
        return True

    def _publish(self, head: int) -> None:
        h = self._h
        h.head = head  # after the bytes: x86 keeps stores in order
        h.seq = (h.seq + 1) & 0xFFFFFFFF
        _futex_wake(self._seq_address)

    # --- consumer ------------------------------------------------------------------

    def get(self, timeout_s: float) -> bytes | None:
        """The next record, waiting at most ``timeout_s`` (None if none came); RingClosed
        once the ring is closed and empty, RingError for a record the producer could
        not have written. A consumer calls it in a loop with a short timeout (a second):
        that bounds how late it sees a close whose wake-up it missed (``close``)."""
        deadline = time.monotonic() + timeout_s
        h = self._h
        while True:
            seq = h.seq  # before looking: a record put after this changes it
            record = self._take()
            if record is not None:
                return record
            if h.closed:  # one look more: a record may have come just before the close
                record = self._take()
                if record is not None:
                    return record
                raise RingClosed()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # Returns at once if seq moved since it was read: no record can slip by.
            _futex_wait(self._seq_address, seq, left)

    def _take(self) -> bytes | None:
        h = self._h
        head, tail = h.head, h.tail
        if head == tail:
            return None
        if head < tail or head - tail > self.capacity or tail % 8:
            raise RingError(f"ring positions out of bounds (head {head}, tail {tail})")
        at = tail % self.capacity
        n = ctypes.c_uint32.from_address(self._data + at).value
        if n == _WRAP:  # the rest of the ring is unused: the next record is at 0
            tail += self.capacity - at
            if tail > head:
                raise RingError("a wrap marker past the ring's head")
            h.tail = tail
            if tail == head:
                return None
            at = 0
            n = ctypes.c_uint32.from_address(self._data).value
        size = _padded(_LEN + n)
        if n > self.max_record or at + size > self.capacity or tail + size > head:
            raise RingError(f"a record of {n} bytes beyond the ring's bounds")
        body = ctypes.string_at(self._data + at + _LEN, n)  # a copy: then checked
        h.tail = tail + size
        return body

    # --- either side ---------------------------------------------------------------

    def close(self) -> None:
        """End the ring: its consumer's ``get`` raises RingClosed once it is empty (at
        once, if it is waiting), its producer's ``put`` raises. Either side may close,
        and Python has no atomic increment: a close that races the producer's bump of
        seq can leave seq as the consumer last read it, and a consumer about to sleep
        then misses this wake-up and sees ``closed`` only when its wait times out."""
        self._h.closed = 1
        self._h.seq = (self._h.seq + 1) & 0xFFFFFFFF
        _futex_wake(self._seq_address)


class Mailbox:
    """Two rings in one segment: ``frames`` (sender -> receiver) and ``acks``."""

    SIZE = Ring.nbytes(FRAME_RING_BYTES) + Ring.nbytes(ACK_RING_BYTES)

    def __init__(self, address: int) -> None:
        self.address = address
        self.frames = Ring(address, FRAME_RING_BYTES)
        self.acks = Ring(address + Ring.nbytes(FRAME_RING_BYTES), ACK_RING_BYTES)

    def close(self) -> None:
        self.frames.close()
        self.acks.close()


class OwnedMailbox(Mailbox):
    """The sender's: a zeroed segment UCX allocates (shared memory, so that a receiver
    on this host can map it), described to the receiver in frame b"M"."""

    def __init__(self, context: int) -> None:
        self.memory = ucp.Memory.allocate(context, self.SIZE)
        ctypes.memset(self.memory.address, 0, self.SIZE)
        super().__init__(self.memory.address)

    def describe(self) -> dict:
        return {"base": self.address, "nbytes": self.SIZE, "rkey": self.memory.pack_rkey().hex()}

    def free(self) -> None:
        """Unmap it here, once neither ring is used on this side any more (a receiver
        that still has it mapped keeps the segment until it lets go)."""
        self.memory.close()


def attach(endpoint: int, description: object) -> tuple[Mailbox, ucp.RemoteKey] | None:
    """The sender's mailbox mapped into this process, from its ``describe()``, or None
    where it cannot be (another host, a segment this process may not attach). The
    key keeps the mapping: close it once neither ring is used any more. ValueError
    when the description is malformed."""
    try:
        base, nbytes = int(description["base"]), int(description["nbytes"])
        packed = bytes.fromhex(description["rkey"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad mailbox description: {exc!r}") from None
    if nbytes != Mailbox.SIZE:
        raise ValueError(f"bad mailbox description: {nbytes} bytes, not {Mailbox.SIZE}")
    if not supported():
        return None
    try:
        rkey = ucp.RemoteKey(endpoint, packed)
    except ucp.UcpError as exc:
        raise ValueError(f"bad mailbox description: {exc}") from None
    pointer, _ = rkey.pointer(base)
    if pointer is None or pointer % 8:
        rkey.close()
        return None
    return Mailbox(pointer), rkey
