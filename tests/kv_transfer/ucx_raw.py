"""Hand-driven UCX peers for tests: a client that speaks (or breaks) the KV protocol one
message at a time, and a listener that plays an impostor decode worker.

They run on the process's UCX loop (``run``), next to any UcxReceiver/UcxSender of
the test, but on endpoints of their own.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint
from tandem.kv_transfer.payload import MessageHeader, encode_header
from tandem.kv_transfer.ucx import wire
from tandem.kv_transfer.ucx.rma import CacheMemory
from tandem.kv_transfer.ucx.runtime import get_runtime


def run(coro, timeout: float = 20.0) -> Any:
    """Run ``coro`` on the UCX loop thread and wait for its result."""
    return get_runtime().submit(coro).result(timeout)


async def connect(address: str):
    host, port = address.rsplit(":", 1)
    return await get_runtime().ucxx.create_endpoint(host, int(port), connect_timeout=10)


async def handshake(
    ep, fp: Fingerprint, address: str, secret: bytes | None = None, proof: bytes | None = None
) -> wire.Reply:
    """HELLO, REPLY and, if the receiver wants one, PROOF (``proof`` overrides the right
    one) and VERDICT. Returns the last answer (error '' if accepted)."""
    nonce_s = auth.new_nonce()
    await wire.send_msg(ep, wire.encode_hello(fp, nonce_s, secret is not None or proof is not None))
    reply = wire.decode_reply(await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))
    if reply.error or reply.proof is None:
        return reply
    if proof is None:
        t = auth.transcript(fp, nonce_s, reply.nonce, address)
        proof = auth.proof(secret, auth.SENDER, t)
    await wire.send_msg(ep, wire.encode_proof(proof))
    return wire.decode_reply(await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT))


async def send_cache(ep, cache: CacheMemory) -> None:
    """The first frame after the handshake: where the sender's cache lies."""
    await wire.send_msg(ep, wire.CACHE_FRAME + cache.describe())


async def send_frame(ep, header: MessageHeader) -> None:
    """A K frame as the real sender writes it (the receiver reads the blocks it names)."""
    await wire.send_msg(ep, wire.KV_FRAME + encode_header(header))


async def send_size(ep, nbytes: int) -> None:
    """A message whose length field announces ``nbytes`` that never follow."""
    await ep.send(struct.pack("<Q", nbytes))


async def closed(ep, timeout: float = 10.0) -> bool:
    """True once the other side has dropped the connection."""
    try:
        await asyncio.wait_for(wire.recv_msg(ep, 0), timeout)
    except (TimeoutError, wire.ProtocolError):  # still open, or it sent something
        return False
    except Exception:  # connection reset / endpoint error: dropped
        return True
    return False


class Impostor:
    """A listener that answers HELLO like a decode worker and records what comes next.

    ``reply(hello) -> bytes`` makes its REPLY (a forged proof, or one relayed from a
    real receiver). ``received`` lists every message after HELLO; ``done`` is set when
    the sender hung up.
    """

    def __init__(self, reply) -> None:
        self.reply = reply
        self.hellos: list[bytes] = []
        self.received: list[bytes] = []
        self.done = asyncio.Event()
        self.listener = get_runtime().ucxx.create_listener(self._serve, port=0)
        self.address = f"127.0.0.1:{self.listener.port}"

    async def _serve(self, ep) -> None:
        try:
            hello = await wire.recv_msg(ep, wire.HANDSHAKE_LIMIT)
            self.hellos.append(hello)
            await wire.send_msg(ep, await self.reply(hello))
            while True:  # ends when the sender drops the connection
                self.received.append(await wire.recv_msg(ep, 1 << 20))
        except Exception:
            pass
        finally:
            self.done.set()
            ep.abort()

    @classmethod
    async def start(cls, reply) -> Impostor:
        return cls(reply)  # ucxx listeners are made on the UCX loop

    def close(self) -> None:
        self.listener.close()
