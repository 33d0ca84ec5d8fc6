"""UCX receiver: a listener whose connections feed one ReceiverCore.

A request's path through one connection: frames are read on the UCX loop thread
and handed, in order, to the connection's own thread, which reads the blocks and
verifies them while the loop reads the next frames (so the next header is already
there when a read ends); acks go back through the loop. With a mailbox (a sender on
this host, mailbox.py) the connection's thread takes the frames from the mailbox's
ring itself and puts its acks in the other ring: no hop through UCX and the loop.

    listen on host:port      ucxx listens on every interface; sockets.restrict_listener
                             drops connections to any other address than ``host``'s
    accept                   the peer's address is looked up (for the log)
    HELLO                    fingerprint compared, then whether both sides have a secret;
                             REPLY: the mismatch (then close), or nonce_r + proof_r
    PROOF (with a secret)    proof_s checked; wrong or missing: VERDICT refused, WARNING
                             with the peer's address, close. Nothing below runs for a
                             peer that has not proved the secret (auth.py)
    frame b"M"+where         -> the sender's cache (rma.RemoteCache): mapped into this
                                process where UCX can, else read with UCX gets; a
                                mailbox on offer is mapped too where UCX can (and
                                ``map_peers``); the answer (MAILBOX) says whether it was
    loop:  frame  b"K"+header -> validated -> the connection's thread:
                                 core.deliver(header, fill): under the reservation's
                                 write lock, if still live, ``fill`` reads the header's
                                 blocks out of the sender's cache into the reserved ones,
                                 which are verified as they land -> ACK if final
           frame  b"A"+id     -> the connection's thread: core.sender_abort(id, conn)
    connection lost (peer killed, closed, protocol error) -> the connection's thread
                                 stops (frames still queued are dropped) -> core.
                                 source_lost: every live request it fed is FAILED("peer
                                 lost"), its reads drained; then the sender's key is
                                 released

Every message is read into a buffer of its kind's limit (wire.recv_msg).
A background sweep expires leases even when the engine does not poll.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint, TransferMetrics
from tandem.kv_transfer.heads import HeadMap
from tandem.kv_transfer.payload import HeaderError, MessageHeader, decode_header
from tandem.kv_transfer.receiver import CoreReceiver, ReceiverCore
from tandem.kv_transfer.ucx import mailbox, rma, sockets, wire
from tandem.kv_transfer.ucx.runtime import get_runtime
from tandem.logs import Throttle

log = logging.getLogger(__name__)
_REFUSAL_CHARS = 300  # of a refusal's text (the peer's values) in the log
# Bounds how long closing an endpoint may block the loop (ucxx's default is 10 s).
_ABORT_PERIOD_NS = 10**9
# close() waits this long for each connection's cleanup (its read in flight, which
# rma.READ_TIMEOUT_S bounds, then its requests and the sender's key), so that nothing
# it needs is shut down under it.
_CLOSE_WAIT_S = rma.READ_TIMEOUT_S + 5


# Frames read but not yet delivered, per connection; past it no more are read until
# the delivery thread has taken half of them (one slow read holds that thread up to
# rma.READ_TIMEOUT_S, while a busy sender goes on sending a frame per layer of each
# request): the sender's frames wait in UCX meanwhile, and no request is failed.
MAX_QUEUED_FRAMES = 4096
# How long an ack may wait for room in a full mailbox before the sender is dropped.
_ACK_ROOM_S = 10.0
# Connections not yet through their handshake, each held up to handshake_timeout_s;
# beyond it a new one is dropped at once, so that peers which connect and stay silent
# cannot take the receiver's memory and descriptors. A sender opens one connection
# per receiver, so only a crowd of strangers comes near it.
MAX_HANDSHAKING = 256


class _Connection:
    """One sender connection (the ``source`` of the requests it feeds)."""

    def __init__(self, ep: object) -> None:
        self.ep = ep
        self.peer = sockets.peer_address(ep)  # "ip:port", for the log
        self.remote: rma.RemoteCache | None = None  # the sender's cache, from frame b"M"
        # How the sender's ranks feed ours, when its tensor-parallel width differs.
        self.heads: HeadMap | None = None
        # Frames the loop has read, delivered in order by this connection's thread while
        # the loop reads the next ones: a header, or the id of a request the sender
        # aborted; None ends the thread.
        self.frames: queue.SimpleQueue[MessageHeader | str | None] = queue.SimpleQueue()
        self.deliverer: threading.Thread | None = None
        self.ending = False  # set before the thread is told to stop: skip what is left
        # The sender's mailbox, mapped here (its key keeps the mapping), when it offered
        # one and it could be: then ``frames`` above stays empty.
        self.mailbox: mailbox.Mailbox | None = None
        self.mailbox_key = None


class UcxReceiver(CoreReceiver):
    def __init__(
        self,
        kv: torch.Tensor,  # [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]
        fingerprint: Fingerprint,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: TransferMetrics | None = None,
        handshake_timeout_s: float = 10.0,
        sweep_interval_s: float = 0.2,
        secret: bytes | None = None,
        max_request_blocks: int | None = None,
        map_peers: bool = True,
    ) -> None:
        """``map_peers`` False: read with UCX gets even from a sender whose cache could
        be mapped here (the other path, for tests and ``tandem bench transfer``)."""
        self.secret = auth.check_secret(secret)
        self.core = ReceiverCore(
            kv, fingerprint, address="", metrics=metrics, max_request_blocks=max_request_blocks
        )
        self._cache = rma.CacheMemory(kv)
        self.map_peers = map_peers
        self.handshake_timeout_s = handshake_timeout_s
        self._refusals = Throttle(log)  # by peer host (_log_refusal)
        self.sweep_interval_s = sweep_interval_s
        self._frame_limit = wire.frame_limit(self.core.max_request_blocks)
        self._rt = get_runtime()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-kv-recv")
        self._connections: set[_Connection] = set()
        self._handshaking = 0
        self._closed = False
        try:
            bound = self._rt.submit(self._start(host, port)).result(timeout=30)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._cache.close()
            raise
        self.core.address = f"{host}:{bound}"

    @property
    def port(self) -> int:
        return int(self.core.address.rsplit(":", 1)[1])

    async def _start(self, host: str, port: int) -> int:
        sockets.listen_addresses(host)  # an unresolvable host fails before listening
        self._listener = self._rt.ucxx.create_listener(
            self._serve, port=port, endpoint_error_handling=True
        )
        try:
            sockets.restrict_listener(self._listener.port, host)
        except Exception:
            self._listener.close()
            raise
        self._sweeper = asyncio.create_task(self._sweep_loop())
        return self._listener.port

    async def _sweep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            await loop.run_in_executor(self._pool, self.core.sweep)

    async def _serve(self, ep: object) -> None:
        if self._closed:
            ep.abort()
            return
        if self._handshaking >= MAX_HANDSHAKING:
            log.warning("KV receiver %s dropped a connection from %s: %d connections are "
                        "in their handshake", self.address, sockets.peer_address(ep),
                        self._handshaking)  # fmt: skip
            ep.abort()
            return
        conn = _Connection(ep)
        self._connections.add(conn)
        try:
            self._handshaking += 1
            try:
                accepted = await self._handshake(conn)
            finally:
                self._handshaking -= 1
            if accepted:
                await self._read_frames(conn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # UCX endpoint errors, protocol errors: drop the peer
            if not self._closed:  # a warning below if it cost requests
                log.info(
                    "KV receiver %s: connection from %s ended: %r", self.address, conn.peer, exc
                )
        finally:
            loop = asyncio.get_running_loop()
            if conn.deliverer is not None:  # no read may start once the key is gone
                conn.ending = True
                conn.frames.put(None)
                if conn.mailbox is not None:  # wakes the thread (and tells the sender)
                    conn.mailbox.close()
                await loop.run_in_executor(self._pool, conn.deliverer.join)
            lost = await loop.run_in_executor(self._pool, self.core.source_lost, conn)
            if lost:
                log.warning(
                    "KV receiver %s: peer %s lost with %d requests",
                    self.address,
                    conn.peer,
                    len(lost),
                )
            if conn.remote is not None:  # source_lost drained its reads
                self._cache.remove_remote(conn.remote)
            if conn.mailbox_key is not None:  # the thread that used the mailbox is over
                conn.mailbox_key.close()
            self._connections.discard(conn)  # after source_lost: close() waits for this
            ep.abort(period=_ABORT_PERIOD_NS)

    async def _recv(self, ep, limit: int) -> bytes:
        return await asyncio.wait_for(wire.recv_msg(ep, limit), self.handshake_timeout_s)

    async def _handshake(self, conn: _Connection) -> bool:
        """True once the peer may send frames; False (refused, logged) otherwise."""
        ep = conn.ep
        try:
            hello = wire.decode_hello(await self._recv(ep, wire.HANDSHAKE_LIMIT))
            problem = self.core.handshake(hello.fingerprint) or auth.presence_problem(
                hello.has_secret, self.secret is not None
            )
            if not problem and len(hello.nonce) != auth.NONCE_BYTES:
                problem = "bad hello: no nonce"
        except wire.ProtocolError as exc:
            problem = str(exc)
        if problem:
            await self._refuse(conn, wire.encode_reply(problem), problem)
            return False
        if self.secret is None:
            await wire.send_msg(ep, wire.encode_reply(""))
            conn.heads = self.core.fingerprint.head_map(hello.fingerprint)
            return True
        nonce_r = auth.new_nonce()
        t = auth.transcript(hello.fingerprint, hello.nonce, nonce_r, self.address)
        await wire.send_msg(
            ep, wire.encode_reply("", nonce_r, auth.proof(self.secret, auth.RECEIVER, t))
        )
        try:
            proof_s = wire.decode_proof(await self._recv(ep, wire.HANDSHAKE_LIMIT))
        except Exception as exc:  # the sender hung up (it refused our proof), or sent junk
            self._log_refusal(conn, f"{auth.FAILED}: no proof of the secret ({exc!r})")
            return False
        if not auth.verify(self.secret, auth.SENDER, t, proof_s):
            await self._refuse(conn, wire.encode_reply(auth.FAILED), auth.FAILED)
            return False
        await wire.send_msg(ep, wire.encode_reply(""))
        conn.heads = self.core.fingerprint.head_map(hello.fingerprint)
        return True

    def _log_refusal(self, conn: _Connection, problem: str) -> None:
        """One line per peer host every 10 s at most, with what the peer sent escaped
        and cut: a refusal comes before the secret is checked, and a HELLO's fields
        (its model name, 64 KiB of newlines and escapes) forged whole log lines, one
        per connection, as fast as a stranger could connect."""
        shown = repr(problem[:_REFUSAL_CHARS])[1:-1]  # control characters escaped
        if len(problem) > _REFUSAL_CHARS:
            shown += f"... ({len(problem)} characters)"
        host = conn.peer.rpartition(":")[0] or conn.peer
        self._refusals.log(logging.WARNING, "KV receiver %s refused a sender at %s: %s",
                           self.address, conn.peer, shown, kind=host)  # fmt: skip

    async def _refuse(self, conn: _Connection, reply: bytes, problem: str) -> None:
        self._log_refusal(conn, problem)
        await wire.send_msg(conn.ep, reply)
        # Keep the endpoint until the sender, having read the reply, hangs up: closing
        # first could let "connection lost" overtake the reply that names the mismatch.
        try:
            await self._recv(conn.ep, 0)
        except Exception:  # the expected end: the sender closed
            pass

    async def _read_frames(self, conn: _Connection) -> None:
        ep, loop = conn.ep, asyncio.get_running_loop()
        frame = await wire.recv_msg(ep, self._frame_limit)
        if frame[:1] != wire.CACHE_FRAME:
            raise wire.ProtocolError(f"expected where the sender's cache lies, got {frame[:1]!r}")
        # On the loop's thread, with no await between the check and the unpack: the
        # unpack reads the UCX endpoint, which close() frees (_stop, on this thread).
        # Unpacked on the pool, a connection closed at once had its endpoint freed under
        # the unpack (a segfault). Unpacking and mapping take microseconds, once per
        # connection.
        if self._closed or ep.closed:
            raise ConnectionError("the connection ended before the sender's cache was known")
        try:
            stuck = TimeoutError("UCX reads outlived their timeout")
            conn.remote = self._cache.add_remote(
                ep.ucp_endpoint, frame[1:], self.map_peers, conn.heads,
                functools.partial(self._drop, conn, asyncio.get_running_loop(), stuck),
            )  # fmt: skip
            offer = json.loads(frame[1:]).get("mailbox")
            if offer is not None and self.map_peers:
                attached = mailbox.attach(ep.ucp_endpoint, offer)
                if attached is not None:
                    conn.mailbox, conn.mailbox_key = attached
        except ValueError as exc:
            raise wire.ProtocolError(str(exc)) from None
        log.debug(
            "KV receiver %s: sender %s's cache %s, control %s",
            self.address,
            conn.peer,
            "mapped" if conn.remote.mapped else "read with UCX gets",
            "through its mailbox" if conn.mailbox is not None else "over UCX",
        )
        if offer is not None:
            await wire.send_msg(ep, wire.encode_mailbox_answer(conn.mailbox is not None))
        conn.deliverer = threading.Thread(
            target=self._deliver, args=(conn, loop), name="tandem-kv-deliver", daemon=True
        )
        conn.deliverer.start()
        reader = wire.Reader(ep, self._frame_limit, depth=1 if conn.mailbox else 8)
        try:
            if conn.mailbox is not None:  # the reader is there to see the endpoint fail
                await reader.next()
                raise wire.ProtocolError("a frame over UCX, where they go through the mailbox")
            await self._queue_frames(conn, reader)
        finally:
            reader.close()

    async def _queue_frames(self, conn: _Connection, reader: wire.Reader) -> None:
        while True:
            conn.frames.put(_parse_frame(await reader.next()))
            if conn.frames.qsize() > MAX_QUEUED_FRAMES:  # the delivery thread is behind
                while conn.frames.qsize() > MAX_QUEUED_FRAMES // 2 and not conn.ending:
                    await asyncio.sleep(0.005)

    def _mailbox_frames(self, conn: _Connection) -> Iterator[MessageHeader | str]:
        """The frames of a connection with a mailbox, as they come, until it ends;
        ProtocolError or RingError for one the sender could not have written."""
        ring = conn.mailbox.frames
        while not conn.ending:
            try:
                record = ring.get(timeout_s=1.0)
                if record is not None and len(record) > self._frame_limit:
                    raise wire.ProtocolError(f"a frame over the limit of {self._frame_limit} bytes")
            except mailbox.RingClosed:
                return
            if record is not None:
                yield _parse_frame(record)

    def _drop(self, conn: _Connection, loop: asyncio.AbstractEventLoop, why: Exception) -> None:
        """End a connection from its thread: the reader sees the endpoint fail and
        cleans up (``_serve``)."""
        log.info("KV receiver %s: dropping sender %s: %r", self.address, conn.peer, why)
        conn.ending = True
        if conn.mailbox is not None:  # the sender hears of it without waiting for UCX
            conn.mailbox.close()
        loop.call_soon_threadsafe(functools.partial(conn.ep.abort, period=_ABORT_PERIOD_NS))

    def _deliver(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        """A connection's thread: its frames in order, each read and verified into its
        reservation (core.deliver), the ack of a final one sent back. Whatever ends it
        early (a frame it cannot take, a bug) ends the connection, as the loop's reader
        does: the requests it fed fail then, rather than wait out their leases."""
        try:
            self._deliver_frames(conn, loop)
        except Exception as exc:
            if not conn.ending:
                self._drop(conn, loop, exc)

    def _deliver_frames(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        if conn.mailbox is not None:
            frames = self._mailbox_frames(conn)
        else:
            frames = iter(conn.frames.get, None)
        for item in frames:
            if conn.ending:
                continue
            if isinstance(item, str):
                self.core.sender_abort(item, conn)
                continue
            fill = None
            if item.nbytes:
                layers = (item.layer_start, item.layer_end)
                fill = functools.partial(
                    self._cache.read,
                    conn.remote,
                    item.src_block_ids,
                    item.dst_block_ids,
                    layers,
                    conn.heads,
                )
            status = self.core.deliver(item, conn, fill, conn.heads)
            if status is None:
                continue
            ack = wire.encode_ack(item.request_id, status)
            if conn.mailbox is None:
                asyncio.run_coroutine_threadsafe(self._send_ack(conn, ack), loop)
            else:
                self._put_ack(conn, loop, ack)

    def _put_ack(self, conn: _Connection, loop: asyncio.AbstractEventLoop, ack: bytes) -> None:
        deadline = time.monotonic() + _ACK_ROOM_S
        try:
            while not conn.mailbox.acks.put(ack):  # the sender is behind on its acks
                if time.monotonic() > deadline or conn.ending:
                    self._drop(conn, loop, TimeoutError(f"no room for an ack in {_ACK_ROOM_S} s"))
                    return
                time.sleep(0.001)
        except mailbox.RingClosed:  # the connection is going: its reader cleans up
            log.debug("KV receiver %s: ack to %s not sent: closed", self.address, conn.peer)

    async def _send_ack(self, conn: _Connection, ack: bytes) -> None:
        try:
            await wire.send_msg(conn.ep, ack)
        except Exception as exc:  # the connection is going: its reader ends and cleans up
            log.debug("KV receiver %s: ack to %s not sent: %r", self.address, conn.peer, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rt.submit(self._stop()).result(timeout=_CLOSE_WAIT_S + 10)
        self.core.close()
        self._pool.shutdown(wait=True)
        self._cache.close()

    async def _stop(self) -> None:
        self._sweeper.cancel()
        self._listener.close()
        for conn in list(self._connections):
            if conn.remote is not None:  # a read posted after the abort would reach freed memory
                conn.remote.rkey.detach()
            conn.ep.abort(period=_ABORT_PERIOD_NS)
        # The readers see their endpoints fail and run their cleanup, which needs the
        # thread pool: close() shuts it down only after this.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_WAIT_S
        while self._connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._connections:
            log.warning(
                "KV receiver %s: closed with %d connections not cleaned up after %.0f s",
                self.address,
                len(self._connections),
                _CLOSE_WAIT_S,
            )


def _parse_frame(frame: bytes) -> MessageHeader | str:
    """A K frame's header, or the request id of an A frame; ProtocolError otherwise."""
    kind, body = frame[:1], frame[1:]
    if kind == wire.ABORT_FRAME:
        return body.decode(errors="replace")
    if kind == wire.KV_FRAME:
        try:
            return decode_header(body)
        except HeaderError as exc:
            raise wire.ProtocolError(f"bad header: {exc}") from None
    raise wire.ProtocolError(f"unknown frame kind {kind!r}")
