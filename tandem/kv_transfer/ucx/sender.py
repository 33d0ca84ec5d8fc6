"""UCX sender: one connection per receiver, shared by every request to it.

A request's path (caller thread, then the UCX loop thread):

    send_layers / send        checksum of the source blocks where they lie, in the
                              caller's thread (sender.py); the receiver reads the
                              blocks in place (rma.py), so nothing is copied here;
                              then call_soon -> the peer's queue, in call order; or,
                              once the peer's mailbox is up and nothing is queued
                              for it, straight into the mailbox from the caller
    first use of an address   a _Peer is created: connect, handshake (wire.py, auth.py):
                              a fingerprint mismatch, a missing secret on either side or
                              a receiver that cannot prove the secret -> HandshakeError
                              for everything queued, and not one frame is sent; then
                              where this cache lies (frame b"M"), and its writer drains
                              the queue and its reader takes acks. On x86-64 Linux
                              frame b"M" offers a mailbox (mailbox.py); a receiver on
                              this host takes it, and frames and acks go through it
    writer                    a header frame per message, posted in order, each without
                              waiting for the last to complete (or put in the mailbox)
    reader                    ACK -> the request's future: DONE status or TransferError;
                              only then may the caller free the request's blocks. With
                              a mailbox, the peer's ack thread takes them from its ring
    failure                   endpoint error (peer killed) -> every request to that peer
                              fails with "peer lost"; the next send reconnects.
                              No ack within ``ack_timeout_s`` of the final message ->
                              "timeout" (and an abort frame, best effort).

Futures resolve on the UCX loop thread, or a mailbox's ack thread: done-callbacks
run there and must not block.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import torch

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import (
    Fingerprint,
    HandshakeError,
    TransferError,
    TransferMetrics,
)
from tandem.kv_transfer.payload import MessageHeader, encode_header
from tandem.kv_transfer.sender import FaultHook, Outgoing, SenderBase
from tandem.kv_transfer.ucx import mailbox, rma, wire
from tandem.kv_transfer.ucx.runtime import get_runtime

log = logging.getLogger(__name__)
# Bounds how long closing an endpoint may block the loop (ucxx's default is 10 s).
_ABORT_PERIOD_NS = 10**9


class _Peer:
    """One connection; lives on the loop thread."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ep = None
        self.queue: asyncio.Queue[tuple[Outgoing, MessageHeader] | str] = asyncio.Queue()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tasks: list[asyncio.Task] = []
        self.sends: set[asyncio.Task] = set()  # frames posted, not yet sent
        self.dead = False
        # The connection's mailbox, once the receiver took it; unmapped when both its
        # users are done with it (the writer, at _lost, and the ack thread).
        self.mailbox: mailbox.OwnedMailbox | None = None
        self.mailbox_users = 0


class UcxSender(SenderBase):
    def __init__(
        self,
        kv: torch.Tensor,
        fingerprint: Fingerprint,
        metrics: TransferMetrics | None = None,
        fault_hook: FaultHook | None = None,
        connect_timeout_s: float = 10.0,
        ack_timeout_s: float = 30.0,
        secret: bytes | None = None,
    ) -> None:
        super().__init__(kv, fingerprint, metrics, fault_hook)
        self.secret = auth.check_secret(secret)
        self._cache = rma.CacheMemory(kv)  # read in place by the receivers
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._rt = get_runtime()
        self._peers: dict[str, _Peer] = {}  # loop thread only
        # Frames go into a peer's mailbox from the callers' threads once its connection
        # is up (``_direct``) and none of the frames handed to the loop for it is still
        # to be written (``_queued``: counted when handed over, uncounted when written,
        # given up, or dropped with a dead peer's queue), so that frames keep their call
        # order. Guards both, and every put into a mailbox's frame ring (its one
        # producer at a time).
        self._route = threading.Lock()
        self._direct: dict[str, _Peer] = {}
        self._queued: dict[str, int] = {}
        self._closed = False
        self._watchdog = self._rt.submit(self._watch_acks())

    # --- caller threads ------------------------------------------------------------

    def connect(self, address: str) -> None:
        """Connect and handshake now (else the first send does); raises HandshakeError."""
        self._rt.submit(self._connected(address)).result(timeout=self.connect_timeout_s + 5)

    def _transmit(self, out: Outgoing, header: MessageHeader) -> None:
        if self._closed:
            self._finish(out, TransferError("closed", "sender closed"))
            return
        address = out.destination.address
        frame = wire.KV_FRAME + encode_header(header) if address in self._direct else None
        with self._route:
            peer = self._direct.get(address)
            if frame is not None and peer is not None and not self._queued.get(address):
                try:
                    if len(frame) <= peer.mailbox.frames.max_record and (
                        peer.mailbox.frames.put(frame)
                    ):
                        return
                except (mailbox.RingClosed, mailbox.RingError):  # the loop's writer says why
                    pass
            self._queued[address] = self._queued.get(address, 0) + 1
            self._rt.call_soon(self._enqueue, address, (out, header))

    def _notify_abort(self, out: Outgoing) -> None:
        if not self._closed:
            self._rt.call_soon(self._enqueue_abort, out.destination.address, out.request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_all(TransferError("closed", "sender closed"))
        self._rt.submit(self._shutdown()).result(timeout=30)
        self._cache.close()

    # --- loop thread ---------------------------------------------------------------

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None or peer.dead:
            peer = _Peer(address)
            self._peers[address] = peer
            peer.tasks.append(asyncio.create_task(self._run_peer(peer)))
        return peer

    def _enqueue(self, address: str, item: tuple[Outgoing, MessageHeader]) -> None:
        self._peer(address).queue.put_nowait(item)

    def _enqueue_abort(self, address: str, request_id: str) -> None:
        peer = self._peers.get(address)
        if peer is not None and not peer.dead:  # nothing to tell a peer we never reached
            peer.queue.put_nowait(request_id)

    async def _connected(self, address: str) -> None:
        await asyncio.shield(self._peer(address).ready)

    async def _run_peer(self, peer: _Peer) -> None:
        try:
            await asyncio.wait_for(self._connect(peer), self.connect_timeout_s)
            peer.ready.set_result(None)
            if peer.mailbox is not None:
                with self._route:
                    self._direct[peer.address] = peer
            peer.tasks.append(asyncio.create_task(self._read_acks(peer)))
            await self._write(peer)
        except asyncio.CancelledError:
            self._lost(peer, TransferError("closed", "sender closed"))
            raise
        except HandshakeError as exc:
            self._lost(peer, exc)
        except TimeoutError:
            why = f"connecting to {peer.address} timed out"
            self._lost(peer, TransferError("unreachable", why))
        except Exception as exc:
            reason = "peer lost" if peer.ready.done() else "unreachable"
            self._lost(peer, TransferError(reason, f"connection to {peer.address}: {exc!r}"))

    async def _connect(self, peer: _Peer) -> None:
        host, port = peer.address.rsplit(":", 1)
        peer.ep = await self._rt.ucxx.create_endpoint(
            host, int(port), endpoint_error_handling=True, connect_timeout=self.connect_timeout_s
        )
        try:
            await self._handshake(peer)
        except wire.ProtocolError as exc:  # not a Tandem receiver, or another protocol
            raise HandshakeError(f"the receiver at {peer.address} answered badly: {exc}") from None
        # Only to a receiver that passed the handshake.
        offer = mailbox.OwnedMailbox(self._rt.context) if mailbox.supported() else None
        try:
            description = self._cache.describe(offer.describe() if offer else None)
            await wire.send_msg(peer.ep, wire.CACHE_FRAME + description)
            taken = offer is not None and wire.decode_mailbox_answer(
                await wire.recv_msg(peer.ep, wire.HANDSHAKE_LIMIT)
            )
        except BaseException:
            if offer is not None:
                offer.free()
            raise
        if not taken:
            if offer is not None:
                offer.free()
            return
        peer.mailbox, peer.mailbox_users = offer, 2
        threading.Thread(
            target=self._take_acks, args=(peer,), name="tandem-kv-acks", daemon=True
        ).start()

    async def _handshake(self, peer: _Peer) -> None:
        """Returns once the receiver accepted us and, with a secret, proved it has it."""
        ep, nonce_s = peer.ep, auth.new_nonce()
        await wire.send_msg(
            ep, wire.encode_hello(self.fingerprint, nonce_s, self.secret is not None)
        )
        reply = wire.decode_reply(await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))
        if reply.error:
            raise HandshakeError(reply.error)
        if self.secret is None:
            return  # a receiver with a secret refuses us instead (reply.error)
        if reply.nonce is None or reply.proof is None:  # it accepted without a secret
            raise HandshakeError(auth.presence_problem(True, False))
        t = auth.transcript(self.fingerprint, nonce_s, reply.nonce, peer.address)
        if not auth.verify(self.secret, auth.RECEIVER, t, reply.proof):
            raise HandshakeError(
                f"{auth.FAILED}: the receiver at {peer.address} did not prove the KV secret "
                "(it has another one, or it is not the decode worker at that address)"
            )
        await wire.send_msg(ep, wire.encode_proof(auth.proof(self.secret, auth.SENDER, t)))
        verdict = wire.decode_reply(await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))
        if verdict.error:
            raise HandshakeError(verdict.error)

    async def _write(self, peer: _Peer) -> None:
        """Posts each frame as it comes, in order, without waiting for the one before to
        complete (UCX keeps one endpoint's messages in order): a request's chunks reach
        the receiver back to back."""
        while True:
            item = await peer.queue.get()
            if isinstance(item, str):  # an aborted request id
                frame = wire.ABORT_FRAME + item.encode()
                await self._send_frame(peer, frame)
                continue
            try:
                frame = self._kv_frame(*item, peer)
                if frame is not None:
                    await self._send_frame(peer, frame)
            finally:  # written, given up, or cancelled with its peer
                self._written(peer.address)

    async def _send_frame(self, peer: _Peer, frame: bytes) -> None:
        if peer.mailbox is None:
            self._post(peer, frame)
        else:
            await self._put_frame(peer, frame)

    def _kv_frame(self, out: Outgoing, header: MessageHeader, peer: _Peer) -> bytes | None:
        """The K frame of ``header``, or None if it is not to be sent: the request is
        over (aborted, failed), or its header is too large for the mailbox (it fails)."""
        if out.future.done():  # the rest of an aborted or failed request is moot
            return None
        frame = wire.KV_FRAME + encode_header(header)
        limit = peer.mailbox.frames.max_record if peer.mailbox else len(frame)
        if len(frame) > limit:
            why = f"a header of {len(frame)} bytes, over the mailbox's {limit}"
            self._finish(out, TransferError("too large", why))
            return None
        return frame

    def _written(self, address: str, frames: int = 1) -> None:
        """``frames`` handed to the loop for ``address`` are out of its queues for good."""
        with self._route:
            left = self._queued.get(address, 0) - frames
            if left > 0:
                self._queued[address] = left
            else:
                self._queued.pop(address, None)

    async def _put_frame(self, peer: _Peer, frame: bytes) -> None:
        """Into the mailbox; while it is full (the receiver is behind), the frames after
        this one wait too. RingClosed (the receiver closed it) or a receiver that takes
        nothing for ``ack_timeout_s`` end the connection."""
        ring, loop = peer.mailbox.frames, asyncio.get_running_loop()
        deadline = loop.time() + self.ack_timeout_s
        while True:
            with self._route:
                if ring.put(frame):
                    return
            if loop.time() > deadline:
                raise ConnectionError(f"the receiver took no frame for {self.ack_timeout_s:g} s")
            await asyncio.sleep(0.001)

    def _post(self, peer: _Peer, frame: bytes) -> None:
        # A task's first step posts its send; tasks start in the order they were made.
        task = asyncio.ensure_future(wire.send_msg(peer.ep, frame))
        peer.sends.add(task)
        task.add_done_callback(functools.partial(self._posted, peer))

    def _posted(self, peer: _Peer, task: asyncio.Task) -> None:
        peer.sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            why = f"connection to {peer.address}: {task.exception()!r}"
            self._lost(peer, TransferError("peer lost", why))

    async def _read_acks(self, peer: _Peer) -> None:
        reader = wire.Reader(peer.ep, wire.ACK_LIMIT, depth=4)
        try:
            while True:
                self._acked(peer, *wire.decode_ack(await reader.next()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lost(peer, TransferError("peer lost", f"connection to {peer.address}: {exc!r}"))
        finally:
            reader.close()

    def _acked(self, peer: _Peer, rid: str, status) -> None:
        with self._lock:
            out = self._requests.get(rid)
        if out is not None and out.destination.address == peer.address:
            self._settle(out, status)

    def _take_acks(self, peer: _Peer) -> None:
        """A mailbox's ack thread: acks from its ring until the connection ends."""
        ring = peer.mailbox.acks
        error = TransferError("peer lost", f"connection to {peer.address} ended")
        try:
            while True:
                record = ring.get(timeout_s=1.0)
                if record is not None:
                    self._acked(peer, *wire.decode_ack(record))
        except mailbox.RingClosed:  # by _lost here, or by the receiver
            error = TransferError("peer lost", f"connection to {peer.address} closed")
        except Exception as exc:  # a bad ack, or what _finish raised
            error = TransferError("peer lost", f"connection to {peer.address}: {exc!r}")
        finally:
            if not self._rt.loop.is_closed():
                self._rt.call_soon(self._lost, peer, error)
                self._rt.call_soon(self._release_mailbox, peer)

    def _release_mailbox(self, peer: _Peer) -> None:
        peer.mailbox_users -= 1
        if peer.mailbox_users == 0 and not rma.exiting():
            peer.mailbox.free()

    def _lost(self, peer: _Peer, error: TransferError) -> None:
        if peer.dead:
            return
        peer.dead = True
        was_connected = peer.ready.done()
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        with self._route:  # frames of the next connection go through the loop at first
            if self._direct.get(peer.address) is peer:
                del self._direct[peer.address]
        dropped = 0  # its queued frames are never written (their requests fail below)
        while not peer.queue.empty():
            dropped += not isinstance(peer.queue.get_nowait(), str)
        self._written(peer.address, dropped)
        if not peer.ready.done():
            peer.ready.set_exception(error)
            peer.ready.exception()  # retrieved: nobody may be waiting on it
        failed = self._fail_all(error, peer.address)
        if not self._closed:
            level = logging.WARNING if failed or not was_connected else logging.INFO
            log.log(level, "KV sender: %s (%d requests failed)", error, failed)
        current = asyncio.current_task()
        for task in [*peer.tasks, *peer.sends]:
            if task is not current:
                task.cancel()
        if peer.ep is not None:
            peer.ep.abort(period=_ABORT_PERIOD_NS)
        if peer.mailbox is not None:  # wakes the ack thread; the writer is cancelled
            peer.mailbox.close()
            self._release_mailbox(peer)

    async def _watch_acks(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [
                    o
                    for o in self._requests.values()
                    if o.final_at is not None and now - o.final_at > self.ack_timeout_s
                ]
            for out in late:
                self._finish(
                    out, TransferError("timeout", f"no ack within {self.ack_timeout_s:g} s")
                )
                self._enqueue_abort(out.destination.address, out.request_id)

    async def _shutdown(self) -> None:
        self._watchdog.cancel()
        for peer in list(self._peers.values()):
            self._lost(peer, TransferError("closed", "sender closed"))
        await asyncio.sleep(0)
