"""UCX receiver: a listener whose connections feed one ReceiverCore.

A request's path through one connection (all on the UCX loop thread, except
``deliver``, which runs on a small thread pool so that checksums and copies of one
connection do not stall the others):

    listen on host:port      ucxx listens on every interface; sockets.restrict_listener
                             drops connections to any other address than ``host``'s
    accept                   the peer's address is looked up (for the log)
    HELLO                    fingerprint compared, then whether both sides have a secret;
                             REPLY: the mismatch (then close), or nonce_r + proof_r
    PROOF (with a secret)    proof_s checked; wrong or missing: VERDICT refused, WARNING
                             with the peer's address, close. Nothing below runs for a
                             peer that has not proved the secret (auth.py)
    nixl:  frame  b"M"+where  -> the sender's cache, for reading its blocks (nixl.py)
    loop:  frame  b"K"+header -> validate -> core.payload_limit: over it -> the request
                                 FAILED "bad header", the connection dropped; no
                                 staging allocated -> payload received into this
                                 connection's staging buffer (the one extra copy: see
                                 receiver.py) -> core.deliver(header, staged) -> ACK
                                 if final (nixl: no payload frame; core.deliver
                                 reads the blocks in place, then verifies them)
           frame  b"A"+id     -> core.sender_abort(id)
    connection lost (peer killed, closed, protocol error) -> core.source_lost:
                                 every live request it fed is FAILED("peer lost")

Every message is read with a size limit checked before allocation (wire.recv_msg).
A background sweep expires leases even when the engine does not poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint, TransferMetrics
from tandem.kv_transfer.payload import HeaderError, decode_header
from tandem.kv_transfer.receiver import CoreReceiver, ReceiverCore
from tandem.kv_transfer.ucx import sockets, wire
from tandem.kv_transfer.ucx.runtime import get_runtime

log = logging.getLogger(__name__)
# Bounds how long closing an endpoint may block the loop (ucxx's default is 10 s).
_ABORT_PERIOD_NS = 10**9


class _Connection:
    """Identity of one sender connection (the ``source`` of the requests it feeds)."""

    def __init__(self, ep: object) -> None:
        self.ep = ep
        self.peer = sockets.peer_address(ep)  # "ip:port", for the log
        self.remote = None  # nixl: the sender's cache (nixl.RemoteKV)


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
        transport: str = "ucx",
    ) -> None:
        self.secret = auth.check_secret(secret)
        if transport not in ("ucx", "nixl"):
            raise ValueError(f"transport must be ucx or nixl, got {transport!r}")
        fingerprint = dataclasses.replace(fingerprint, transport=transport)
        self.core = ReceiverCore(
            kv, fingerprint, address="", metrics=metrics, max_request_blocks=max_request_blocks
        )
        # "nixl": payloads are read out of the sender's cache into the blocks (ucx/nixl.py).
        self._nixl = None
        if transport == "nixl":
            from tandem.kv_transfer.ucx.nixl import NixlKV

            self._nixl = NixlKV(kv, "decode")
        self.handshake_timeout_s = handshake_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self._frame_limit = wire.frame_limit(self.core.max_request_blocks)
        self._rt = get_runtime()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-kv-recv")
        self._connections: set[_Connection] = set()
        self._closed = False
        try:
            bound = self._rt.submit(self._start(host, port)).result(timeout=30)
        except BaseException:
            self._pool.shutdown(wait=False)
            if self._nixl is not None:
                self._nixl.close()
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
        conn = _Connection(ep)
        self._connections.add(conn)
        try:
            if await self._handshake(conn):
                await self._read_frames(conn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # UCX endpoint errors, protocol errors: drop the peer
            if not self._closed:  # a warning below if it cost requests
                log.info(
                    "KV receiver %s: connection from %s ended: %r", self.address, conn.peer, exc
                )
        finally:
            lost = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.core.source_lost, conn
            )
            if lost:
                log.warning(
                    "KV receiver %s: peer %s lost with %d requests",
                    self.address,
                    conn.peer,
                    len(lost),
                )
            if conn.remote is not None:  # source_lost drained its reads
                self._nixl.remove_remote(conn.remote)
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
            await ep.send_obj(wire.encode_reply(""))
            return True
        nonce_r = auth.new_nonce()
        t = auth.transcript(self.core.fingerprint, hello.nonce, nonce_r, self.address)
        await ep.send_obj(wire.encode_reply("", nonce_r, auth.proof(self.secret, auth.RECEIVER, t)))
        try:
            proof_s = wire.decode_proof(await self._recv(ep, wire.HANDSHAKE_LIMIT))
        except Exception as exc:  # the sender hung up (it refused our proof), or sent junk
            self._log_refusal(conn, f"{auth.FAILED}: no proof of the secret ({exc!r})")
            return False
        if not auth.verify(self.secret, auth.SENDER, t, proof_s):
            await self._refuse(conn, wire.encode_reply(auth.FAILED), auth.FAILED)
            return False
        await ep.send_obj(wire.encode_reply(""))
        return True

    def _log_refusal(self, conn: _Connection, problem: str) -> None:
        log.warning("KV receiver %s refused a sender at %s: %s", self.address, conn.peer, problem)

    async def _refuse(self, conn: _Connection, reply: bytes, problem: str) -> None:
        self._log_refusal(conn, problem)
        await conn.ep.send_obj(reply)
        # Keep the endpoint until the sender, having read the reply, hangs up: closing
        # first could let "connection lost" overtake the reply that names the mismatch.
        try:
            await self._recv(conn.ep, 0)
        except Exception:  # the expected end: the sender closed
            pass

    async def _read_frames(self, conn: _Connection) -> None:
        ep, loop, core = conn.ep, asyncio.get_running_loop(), self.core
        # Grown to the largest payload seen; one per connection, since a connection
        # receives its next payload only after the previous one was delivered.
        staging = torch.empty(0, dtype=torch.uint8, device=core.kv.device)
        if self._nixl is not None:
            frame = await wire.recv_msg(ep, self._frame_limit)
            if frame[:1] != wire.NIXL_FRAME:
                raise wire.ProtocolError(
                    f"expected where the sender's cache lies, got {frame[:1]!r}"
                )
            try:
                conn.remote = await loop.run_in_executor(
                    self._pool, self._nixl.add_remote, frame[1:]
                )
            except ValueError as exc:
                raise wire.ProtocolError(str(exc)) from None
        while True:
            frame = await wire.recv_msg(ep, self._frame_limit)
            kind, body = frame[:1], frame[1:]
            if kind == wire.ABORT_FRAME:
                rid = body.decode(errors="replace")
                await loop.run_in_executor(self._pool, core.sender_abort, rid, conn)
                continue
            if kind != wire.KV_FRAME:
                raise wire.ProtocolError(f"unknown frame kind {kind!r}")
            try:
                header = decode_header(body)
            except HeaderError as exc:
                raise wire.ProtocolError(f"bad header: {exc}") from None
            payload = fill = None
            if header.nbytes:
                limit = core.payload_limit(header)
                if header.nbytes > limit:
                    problem = (
                        f"payload of {header.nbytes} bytes for layers [{header.layer_start}, "
                        f"{header.layer_end}) over the {limit} bytes its reservation can hold"
                    )
                    await loop.run_in_executor(self._pool, core.reject, header, conn, problem)
                    raise wire.ProtocolError(f"{header.request_id}: {problem}")
            if header.nbytes and self._nixl is not None:
                layers = (header.layer_start, header.layer_end)
                fill = functools.partial(
                    self._nixl.read,
                    conn.remote,
                    header.src_block_ids,
                    header.dst_block_ids,
                    layers,
                )
            elif header.nbytes:
                if staging.numel() < header.nbytes:
                    staging = torch.empty(header.nbytes, dtype=torch.uint8, device=core.kv.device)
                payload = staging[: header.nbytes]
                await ep.recv(wire.wire_buffer(payload))
            status = await loop.run_in_executor(
                self._pool, core.deliver, header, payload, conn, fill
            )
            if status is not None:
                await ep.send_obj(wire.encode_ack(header.request_id, status))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rt.submit(self._stop()).result(timeout=30)
        self.core.close()
        self._pool.shutdown(wait=True)
        if self._nixl is not None:
            self._nixl.close()

    async def _stop(self) -> None:
        self._sweeper.cancel()
        self._listener.close()
        for conn in list(self._connections):
            conn.ep.abort(period=_ABORT_PERIOD_NS)
        # The readers see their endpoints fail and run their cleanup.
        for _ in range(100):
            if not self._connections:
                break
            await asyncio.sleep(0.01)
