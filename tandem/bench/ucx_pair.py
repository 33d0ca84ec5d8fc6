"""A sender (this process) and a receiver process joined by one UCX endpoint.

The transfer benchmark's two ends, on the ucxx core API (``ucxx._lib.libucxx``,
as ucxx's own benchmarks use it) so that endpoint error handling and the
progress mode are the caller's choice. The protocol, all tagged messages:

    sender                                        receiver
    control [message_bytes, messages, iters]  ->  allocates its buffers once
    per iteration:  messages x tag_send       ->  messages x tag_recv into them
                    wait for the ack          <-  ack once every message landed
    after the last: compare CRC32s            <-  CRC32 of what it received
    control [0, 0, 0], close the endpoint,
    "closed" on the pipe                      ->  exits
"""

from __future__ import annotations

import os
import sys
import time
import zlib

from tandem.errors import TandemError

PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")
CTRL_TAG, ACK_TAG, DATA_TAG = 1, 2, 16  # data messages use DATA_TAG + layer index
WAIT_S = 60.0  # no single round trip on one host takes this long unless the peer is gone
# Shared-memory transports do not always signal the worker's event fd: an epoll wait
# without a timeout can sleep through a completed transfer (the "thread" mode hung
# that way). ucxx's own progress thread uses 1 ms for the same reason.
EPOLL_TIMEOUT_MS = 1


class Worker:
    """A UCX worker plus the one way this run drives its progress."""

    def __init__(self, progress: str) -> None:
        from ucxx._lib import libucxx as ucx

        self.ucx = ucx
        self.progress = progress
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        if progress.startswith("thread"):
            self.worker.start_progress_thread(
                polling_mode=progress == "thread-polling", epoll_timeout=EPOLL_TIMEOUT_MS
            )
        else:
            self.worker.init_blocking_progress_mode()

    def until(self, done, what: str, timeout: float = WAIT_S, peer=None) -> None:
        """Drive progress until ``done()``; ``peer``: the other process, whose exit is an error."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.progress == "polling":
                self.worker.progress()
            elif self.progress == "blocking":
                self.worker.progress_worker_event(epoll_timeout=EPOLL_TIMEOUT_MS)
            else:
                time.sleep(0)  # the progress thread does the work; let it have the GIL
            if time.monotonic() > deadline:
                raise TandemError(f"transfer benchmark: {what} not done after {timeout:.0f} s")
            if peer is not None and not peer.is_alive():
                raise TandemError(f"transfer benchmark: {peer.name} exited during the {what}")

    def wait(self, requests: list, what: str, timeout: float = WAIT_S, peer=None) -> None:
        self.until(lambda: all(r.completed for r in requests), what, timeout, peer)
        try:
            for r in requests:
                r.check_error()
        except Exception as exc:  # ucxx raises one class per UCS status
            tls = os.environ.get("UCX_TLS", "")
            hint = (
                f" (UCX_TLS={tls} lacks tcp, which connecting needs)"
                if tls and "tcp" not in tls
                else ""
            )
            raise TandemError(f"transfer benchmark: {what} failed: {exc}{hint}") from exc

    def send(self, ep, array, tag: int):
        from ucxx._lib.arr import Array

        return ep.tag_send(Array(array), tag=self.ucx.UCXXTag(tag))

    def recv(self, ep, array, tag: int):
        from ucxx._lib.arr import Array

        return ep.tag_recv(Array(array), tag=self.ucx.UCXXTag(tag))

    def close(self) -> None:
        if self.progress.startswith("thread"):
            self.worker.stop_progress_thread()


def crc32(buffers) -> int:
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b.data, crc)
    return crc


# --- receiver process -------------------------------------------------------------


def _receiver(conn, progress: str, error_handling: bool) -> None:
    """Accepts one sender and answers control messages until a zero one arrives."""
    import multiprocessing

    import numpy as np

    w = Worker(progress)
    sender = multiprocessing.parent_process()  # if it dies, so does this process
    accepted = []

    def on_connect(conn_request) -> None:
        accepted.append(listener.create_endpoint_from_conn_request(conn_request, error_handling))

    listener = w.ucx.UCXListener.create(worker=w.worker, port=0, cb_func=on_connect)
    conn.send(listener.port)
    w.until(lambda: accepted, "sender connection", peer=sender)
    ep = accepted[0]
    ctrl = np.zeros(3, dtype=np.int64)  # [message_bytes, messages, iterations]
    ack = np.zeros(1, dtype=np.uint64)
    while True:
        # The sender fills and memcpy-times each size between control messages.
        w.wait([w.recv(ep, ctrl, CTRL_TAG)], "control message", 10 * WAIT_S, sender)
        message_bytes, messages, iterations = (int(x) for x in ctrl)
        if messages == 0:
            break
        buffers = [np.empty(message_bytes, dtype=np.uint8) for _ in range(messages)]
        for _ in range(iterations):
            recvs = [w.recv(ep, b, DATA_TAG + i) for i, b in enumerate(buffers)]
            w.wait(recvs, "payload", peer=sender)
            w.wait([w.send(ep, ack, ACK_TAG)], "ack", peer=sender)
        ack[0] = crc32(buffers)
        w.wait([w.send(ep, ack, ACK_TAG)], "checksum", peer=sender)
        ack[0] = 0
    # The sender closes the link while this side keeps progressing, then says so on the
    # pipe. Closing this end too would flush towards a peer that has disconnected, which
    # UCX reports as an error ("Connection reset by remote peer"), so leave without it.
    w.until(conn.poll, "sender's close", peer=sender)
    sys.stderr.flush()
    os._exit(0)


# --- sender side (this process) ----------------------------------------------------


class Sender:
    """This process's end; ``start()`` spawns and connects the receiver."""

    def __init__(self, progress: str, error_handling: bool) -> None:
        import multiprocessing

        self.error_handling = error_handling
        self.w = Worker(progress)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_receiver,
            args=(child, progress, error_handling),
            name="the transfer receiver",
            daemon=True,
        )
        self.ep = None

    def start(self) -> None:
        """Starts the receiver and connects to it; ``kill()`` must follow, even on error."""
        self.proc.start()
        if not self.conn.poll(WAIT_S):
            raise TandemError("transfer benchmark: the receiver process did not start")
        port = self.conn.recv()
        self.ep = self.w.ucx.UCXEndpoint.create(
            self.w.worker, "127.0.0.1", port, self.error_handling
        )

    def ctrl(self, message_bytes: int, messages: int, iterations: int) -> None:
        import numpy as np

        self._ctrl = np.array([message_bytes, messages, iterations], dtype=np.int64)
        self.w.wait([self.w.send(self.ep, self._ctrl, CTRL_TAG)], "control message", peer=self.proc)

    def measure(self, buffers, iterations: int) -> list[float]:
        """Seconds per round trip: every message sent and the receiver's ack back."""
        import numpy as np

        ack = np.zeros(1, dtype=np.uint64)
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            reqs = [self.w.send(self.ep, b, DATA_TAG + i) for i, b in enumerate(buffers)]
            reqs.append(self.w.recv(self.ep, ack, ACK_TAG))
            self.w.wait(reqs, "payload round trip", peer=self.proc)
            times.append(time.perf_counter() - start)
        return times

    def checksum(self) -> int:
        import numpy as np

        crc = np.zeros(1, dtype=np.uint64)
        self.w.wait([self.w.recv(self.ep, crc, ACK_TAG)], "checksum", peer=self.proc)
        return int(crc[0])

    def shutdown(self) -> None:
        """The orderly end, after a successful run; see the end of ``_receiver``."""
        self.ctrl(0, 0, 0)  # a small send completes locally, even towards a dead peer
        self.ep.close_blocking(period=10**9)
        try:
            self.conn.send("closed")
        except OSError as exc:
            raise TandemError(f"transfer benchmark: {self.proc.name} is gone ({exc})") from exc
        self.proc.join(5)
        if self.proc.exitcode != 0:
            raise TandemError(
                f"transfer benchmark: {self.proc.name} exited with code {self.proc.exitcode}"
            )

    def kill(self) -> None:
        """Always called: ends the receiver whatever state the link is in."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.w.close()
