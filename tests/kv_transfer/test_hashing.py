from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

import pytest
import torch

from tandem.kv_transfer import hashing
from tandem.kv_transfer.payload import checksum_blocks, copy_blocks
from tests.kv_transfer.conftest import make_side

LAYERS = (0, 4)
_POOL = hashing.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-kv-hash")


@pytest.fixture
def parallel(monkeypatch):
    """Every message hashed on three threads, however small and short its runs."""
    monkeypatch.setattr(hashing, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(hashing, "GIL_MIN_BYTES", 0)
    monkeypatch.setattr(hashing, "_threads", lambda: 3)
    monkeypatch.setattr(hashing, "_pool", lambda: _POOL)


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [5, 6, 1, 2, 9], [7]], ids=["run", "three", "1"])
def test_threads_give_the_digest_one_thread_gives(ids, parallel, monkeypatch) -> None:
    kv = torch.randn(4, 2, 11, 16, 2, 8)
    threaded = checksum_blocks(kv, ids, LAYERS)
    monkeypatch.setattr(hashing, "PARALLEL_MIN_BYTES", 1 << 40)
    assert threaded == checksum_blocks(kv, ids, LAYERS)


def test_threads_copy_every_layer_and_hash_what_landed(parallel) -> None:
    src, dst = make_side(32, seed=4), make_side(40)
    src_ids, dst_ids = (9, 10, 2, 30), (1, 2, 17, 5)
    digest = copy_blocks(dst.kv, src.kv.data_ptr(), src.kv.shape[2], src_ids, dst_ids, LAYERS)
    assert torch.equal(dst.kv[:, :, list(dst_ids)], src.kv[:, :, list(src_ids)])
    assert digest == checksum_blocks(src.kv, list(src_ids), LAYERS)
    assert digest == checksum_blocks(dst.kv, list(dst_ids), LAYERS)


def test_only_a_large_message_of_long_runs_goes_to_threads(monkeypatch) -> None:
    monkeypatch.setattr(hashing, "_threads", lambda: 2)
    callers = set()

    def work(layer: int, digest: hashing.Digest) -> None:
        callers.add(threading.current_thread().name)

    big = hashing.PARALLEL_MIN_BYTES
    short = big // 4 // hashing.GIL_MIN_BYTES + 1  # updates per layer, each under 64 KiB
    for nbytes, updates, threads in [(big, 1, 2), (big - 1, 1, 1), (big, short, 1)]:
        callers.clear()
        hashing.layer_digests(work, range(4), nbytes, updates)
        assert len(callers) == threads, (nbytes, updates)


def _ticks_during(update, nbytes: int) -> int:
    """How often another Python thread ran while ``update`` hashed ``nbytes``, with the
    interpreter told not to switch threads on its own: only a released GIL lets it."""
    data = torch.zeros(nbytes, dtype=torch.uint8)
    done, ticks = threading.Event(), []

    def tick() -> None:
        while not done.is_set():
            ticks.append(1)
            time.sleep(0)  # lets the hashing thread back in once its call returns

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30)
    ticker = threading.Thread(target=tick)
    try:
        ticker.start()
        before = len(ticks)
        update(data.data_ptr(), nbytes)
        during = len(ticks) - before
    finally:
        done.set()
        sys.setswitchinterval(interval)
        ticker.join()
    return during


def test_a_long_update_releases_the_gil_so_threads_overlap() -> None:
    assert _ticks_during(hashing.Digest().update, 256 << 20) > 0

    def short_updates(address: int, nbytes: int) -> None:
        digest, step = hashing.Digest(), hashing.GIL_MIN_BYTES // 2
        for at in range(0, nbytes, step):
            digest.update(address + at, step)

    assert _ticks_during(short_updates, 64 << 20) == 0  # why short runs stay on one thread


def test_a_failed_layer_fails_the_message_after_every_thread_finished(parallel) -> None:
    started, finished = [], []

    def work(layer: int, digest: hashing.Digest) -> None:
        started.append(layer)
        if layer == 0:
            raise OSError("read failed")
        threading.Event().wait(0.05)
        finished.append(layer)

    with pytest.raises(OSError, match="read failed"):
        hashing.layer_digests(work, range(6), 1 << 30, 1)
    # Three threads, two layers each: the caller's share stopped at its first layer,
    # and the others had finished theirs when the error reached the caller.
    assert 1 not in started and sorted(finished) == [2, 3, 4, 5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_hashes_on_threads_of_its_own(monkeypatch) -> None:
    monkeypatch.setattr(hashing, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(hashing, "GIL_MIN_BYTES", 0)
    monkeypatch.setattr(hashing, "_threads", lambda: 2)
    hashing._pool.cache_clear()
    kv = torch.randn(4, 2, 11, 16, 2, 8)
    want = checksum_blocks(kv, [1, 2, 3], LAYERS)  # the parent's pool now has a thread
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a hang here would be the parent's dead pool
        try:
            os.write(write, str(checksum_blocks(kv, [1, 2, 3], LAYERS)).encode())
        finally:
            os._exit(0)
    os.close(write)
    ready: list = []
    try:
        ready, _, _ = select.select([read], [], [], 30)
        got = os.read(read, 64).decode() if ready else "no answer within 30 s"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        hashing._pool().shutdown()
        hashing._pool.cache_clear()
    assert got == str(want)
