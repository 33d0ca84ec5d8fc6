"""The mailbox's rings (tandem/kv_transfer/ucx/mailbox.py), alone: order, wrap-around,
a full ring, a closed one, records its producer could not have written, and a
producer in another process waking its consumer through the futex."""

from __future__ import annotations

import ctypes
import mmap
import random
import subprocess
import sys
import threading
import time

import pytest

from tandem.kv_transfer.ucx import mailbox
from tandem.kv_transfer.ucx.mailbox import Ring, RingClosed, RingError

pytestmark = pytest.mark.skipif(not mailbox.supported(), reason="mailboxes are x86-64 Linux")

CAPACITY = 4096


@pytest.fixture
def memory():
    """Zeroed shared memory for one ring (a fork's child sees the same pages)."""
    m = mmap.mmap(-1, Ring.nbytes(CAPACITY), flags=mmap.MAP_SHARED)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    yield ctypes.addressof(buf)
    del buf
    m.close()


def _records(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([0, 1, 7, 8, 100, 1000, 3000])) for _ in range(n)]


def test_records_come_out_whole_and_in_order_across_many_wraps(memory) -> None:
    ring = Ring(memory, CAPACITY)
    records = _records(1, 500)  # about 100 times the ring's size
    out, pending = [], list(records)
    for _ in range(10 * len(records)):  # each round moves at least a record: no hang
        if not pending and len(out) == len(records):
            break
        while pending and ring.put(pending[0]):
            pending.pop(0)
        record = ring.get(timeout_s=0)
        if record is not None:  # None: only a wrap marker was there
            out.append(record)
    assert out == records


def test_a_full_ring_refuses_until_its_consumer_takes(memory) -> None:
    ring = Ring(memory, CAPACITY)
    n = 0
    while ring.put(bytes(1000)):
        n += 1
    assert n == CAPACITY // 1008  # each record: its length and padding, 1008 bytes
    assert ring.get(timeout_s=0) == bytes(1000)
    assert ring.put(b"x" * 1000)
    with pytest.raises(ValueError, match="over the ring's"):
        ring.put(bytes(ring.max_record + 1))


def test_get_waits_at_most_its_timeout_and_close_wakes_it(memory) -> None:
    ring = Ring(memory, CAPACITY)
    start = time.monotonic()
    assert ring.get(timeout_s=0.05) is None
    assert 0.04 < time.monotonic() - start < 1.0
    woken = []

    def consume() -> None:
        try:
            ring.get(timeout_s=30)
        except RingClosed:
            woken.append(time.monotonic())

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.1)
    closed = time.monotonic()
    Ring(memory, CAPACITY).close()  # the other side's view of the same ring
    t.join(timeout=10)
    assert woken and woken[0] - closed < 1.0
    with pytest.raises(RingClosed):
        ring.put(b"late")


def test_records_put_before_a_close_are_still_taken(memory) -> None:
    ring = Ring(memory, CAPACITY)
    assert ring.put(b"last words")
    ring.close()
    assert ring.get(timeout_s=0) == b"last words"
    with pytest.raises(RingClosed):
        ring.get(timeout_s=0)


def test_a_record_put_as_the_consumer_finds_the_ring_empty_then_closed_is_taken(memory) -> None:
    # The producer's last record (an ack) and its close land between the consumer's
    # look at an empty ring and its look at the closed flag.
    producer, consumer = Ring(memory, CAPACITY), Ring(memory, CAPACITY)
    take, looks = consumer._take, []

    def take_then_the_producer_acts():
        record = take()
        if not looks:
            assert producer.put(b"the last ack")
            producer.close()
        looks.append(record)
        return record

    consumer._take = take_then_the_producer_acts
    assert consumer.get(timeout_s=0.5) == b"the last ack"
    with pytest.raises(RingClosed):
        consumer.get(timeout_s=0)


@pytest.mark.parametrize(
    "scribble, match",
    [
        (lambda h, d: setattr(h, "head", CAPACITY * 3), "out of bounds"),
        (lambda h, d: setattr(h, "tail", 4), "out of bounds"),
        (lambda h, d: (setattr(h, "head", 16), d.__setitem__(0, CAPACITY)), "beyond"),
        (lambda h, d: (setattr(h, "head", 16), d.__setitem__(0, 100)), "beyond"),
        (lambda h, d: (setattr(h, "head", 8), d.__setitem__(0, 0xFFFFFFFF)), "wrap marker"),
    ],
    ids=["head-past-capacity", "tail-misaligned", "length-over-ring", "length-past-head", "wrap"],
)
def test_what_no_producer_writes_is_refused(memory, scribble, match) -> None:
    ring = Ring(memory, CAPACITY)
    head = mailbox._Head.from_address(memory)
    data = (ctypes.c_uint32 * 4).from_address(memory + mailbox._HEAD_BYTES)
    scribble(head, data)
    with pytest.raises(RingError, match=match):
        ring.get(timeout_s=0)


@pytest.mark.parametrize("head, tail", [(12, 0), (CAPACITY * 2, 0), (0, 8)])
def test_a_producer_refuses_positions_its_peer_scribbled(memory, head, tail) -> None:
    # The positions lie in memory both processes write: an unaligned head or one that
    # is not within a ring's length of the tail would have put write outside the ring,
    # or over records not yet taken.
    ring = Ring(memory, CAPACITY)
    h = mailbox._Head.from_address(memory)
    h.head, h.tail = head, tail
    with pytest.raises(RingError, match="out of bounds"):
        ring.put(b"x")


_PRODUCER = """
import ctypes, mmap, random, sys, time
from tandem.kv_transfer.ucx.mailbox import Ring
path, capacity, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
buf = (ctypes.c_char * len(m)).from_buffer(m)
ring = Ring(ctypes.addressof(buf), capacity)
rng = random.Random(seed)
deadline = time.monotonic() + 60
for _ in range(n):
    record = rng.randbytes(rng.choice([0, 1, 7, 8, 100, 1000, 3000]))
    while not ring.put(record):  # waits for room, as the sender's writer does
        if time.monotonic() > deadline:
            sys.exit("the consumer stopped taking records")
        time.sleep(0.0001)
"""


def test_a_producer_in_another_process_wakes_the_consumer(tmp_path) -> None:
    # A separate interpreter (not a fork of this threaded one) maps the same file.
    path = tmp_path / "ring"
    path.write_bytes(bytes(Ring.nbytes(CAPACITY)))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    ring = Ring(ctypes.addressof(buf), CAPACITY)
    records = _records(2, 2000)
    producer = subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, str(path), str(CAPACITY), "2", str(len(records))]
    )
    try:
        got = []
        while len(got) < len(records):
            record = ring.get(timeout_s=30)
            assert record is not None, f"nothing came for 30 s after {len(got)} records"
            got.append(record)
        assert producer.wait(timeout=30) == 0
    finally:
        producer.kill()
        producer.wait()
    assert got == records
    del buf
    m.close()
