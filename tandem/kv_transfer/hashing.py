"""A message's KV checksum, its layers hashed (and copied) on several threads at once.

A message's checksum (payload.checksum_blocks) is the xxh3_64 of its layers'
digests, each layer's the xxh3_64 of its K runs then its V runs. So the digest does
not depend on how many threads hashed which layers, and both sides of a transfer
may split a large message's layers over their cores: the sender's checksum and the
receiver's copy-and-verify were each one thread's pass over every byte, on cores
that the other side leaves idle meanwhile.

The threads overlap because xxhash's streaming update releases the GIL while it
hashes more than 64 KiB (``GIL_MIN_BYTES``; every update before xxhash 4), as
``ctypes.memmove`` does. A message whose runs are shorter than that on average is
hashed on the caller's thread: its threads would spend their time waiting for the
GIL between short calls (a 16 MiB message of one-block runs took 8 ms on two
threads against 5 ms on one). So is a small message: a thread hand-off costs some
tens of microseconds.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import xxhash

# A message of fewer bytes is hashed (and copied) on the caller's thread.
PARALLEL_MIN_BYTES = 4 << 20
# xxhash's update holds the GIL for fewer bytes: a message whose updates are shorter
# on average is hashed on the caller's thread.
GIL_MIN_BYTES = 64 << 10
# At most this many threads work on one message (the caller's among them).
MAX_THREADS = 4


def combine(digests: list[int]) -> int:
    """The checksum of a message whose layers' digests are ``digests``, in layer order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


class Digest:
    """A streaming xxh3_64 fed from host memory by address."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, address: int, nbytes: int) -> None:
        self._state.update(memoryview((ctypes.c_char * nbytes).from_address(address)))

    def intdigest(self) -> int:
        return self._state.intdigest()


# One layer's work: feed the given digest the layer's bytes (copying them first, on
# the receiver).
LayerWork = Callable[[int, Digest], None]


@functools.cache
def _threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_threads() - 1, thread_name_prefix="tandem-kv-hash")


# A forked child has none of the pool's threads: it makes its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def layer_digests(work: LayerWork, layers: range, nbytes: int, updates: int) -> list[int]:
    """Each layer's digest, in order, ``work`` fed a fresh digest per layer: a message
    of ``nbytes`` in ``updates`` updates per layer, on the caller's thread where it is
    small or its updates short, else its layers split over up to MAX_THREADS threads
    (the caller's among them)."""
    threads = min(_threads(), len(layers))
    short = nbytes < GIL_MIN_BYTES * updates * len(layers)
    if threads < 2 or nbytes < PARALLEL_MIN_BYTES or short:
        return _digests(work, layers)
    bounds = [len(layers) * i // threads for i in range(threads + 1)]
    parts = [layers[bounds[i] : bounds[i + 1]] for i in range(threads)]
    with _running(work, parts[1:]) as others:
        mine = _digests(work, parts[0])
    return mine + [d for f in others for d in f.result()]


def _digests(work: LayerWork, layers: range) -> list[int]:
    out = []
    for layer in layers:
        digest = Digest()
        work(layer, digest)
        out.append(digest.intdigest())
    return out


@contextmanager
def _running(work: LayerWork, parts: list[range]) -> Iterator[list]:
    """``_digests`` of ``parts`` on the pool; on the way out every one has finished (a
    caller whose own share raised must not return while the others still write)."""
    futures = [_pool().submit(_digests, work, part) for part in parts]
    try:
        yield futures
    finally:
        for f in futures:
            f.exception()  # waits; result() above re-raises
