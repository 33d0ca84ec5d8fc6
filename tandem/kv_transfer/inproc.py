"""In-process backend: sender and receiver in one process, blocks copied directly.

Used by unit tests. A request's path:

    InProcReceiver(kv, fingerprint)     registers itself under "inproc://<name>"
    receiver.expect(...) -> Destination
    InProcSender.send(destination, ...) first contact with an address: handshake
                                        (fingerprints compared, then the two secrets:
                                        HandshakeError on any mismatch)
                                        receiver core deliver: the blocks copied out of
                                        the sender's cache into the reserved ones and
                                        verified (payload.copy_blocks), all in the
                                        caller's thread
    future already resolved when send returns

The same in-place read as the UCX backend's between processes on one host, with
the sender's tensor in place of a mapped segment. Host caches only.

``secret``: both ends live in one process, so nothing needs proving; the secrets
are still compared (auth.local_problem: same presence, same bytes), so that a
test or a colocated setup with mismatched secrets fails as the UCX backend would.
"""

from __future__ import annotations

import functools
import itertools
import threading

import torch

from tandem.errors import ConfigError
from tandem.kv_transfer import auth
from tandem.kv_transfer.base import Fingerprint, HandshakeError, TransferError, TransferMetrics
from tandem.kv_transfer.heads import HeadMap
from tandem.kv_transfer.payload import MessageHeader, checksum_blocks, copy_blocks
from tandem.kv_transfer.receiver import CoreReceiver, ReceiverCore
from tandem.kv_transfer.sender import FaultHook, Outgoing, SenderBase

_registry_lock = threading.Lock()
_registry: dict[str, InProcReceiver] = {}
_names = itertools.count()


def _host_only(kv: torch.Tensor) -> None:
    """Its copies are ``memmove`` between host addresses: a device pointer would crash
    the process."""
    if kv.device.type != "cpu":
        raise ConfigError(
            f"kv_backend: inproc copies KV caches in host memory only, and this one is on "
            f"{kv.device}; use kv_backend: ucx"
        )


class InProcReceiver(CoreReceiver):
    def __init__(
        self,
        kv: torch.Tensor,
        fingerprint: Fingerprint,
        name: str | None = None,
        metrics: TransferMetrics | None = None,
        secret: bytes | None = None,
        max_request_blocks: int | None = None,
    ) -> None:
        _host_only(kv)
        self.secret = auth.check_secret(secret)
        address = f"inproc://{name if name is not None else f'receiver-{next(_names)}'}"
        self.core = ReceiverCore(
            kv, fingerprint, address, metrics, max_request_blocks=max_request_blocks
        )
        with _registry_lock:
            if address in _registry:
                raise ValueError(f"an in-process receiver is already named {address}")
            _registry[address] = self

    def close(self) -> None:
        with _registry_lock:
            if _registry.get(self.address) is self:
                del _registry[self.address]
        self.core.close()


class InProcSender(SenderBase):
    def __init__(
        self,
        kv: torch.Tensor,
        fingerprint: Fingerprint,
        metrics: TransferMetrics | None = None,
        fault_hook: FaultHook | None = None,
        secret: bytes | None = None,
    ) -> None:
        _host_only(kv)
        super().__init__(kv, fingerprint, metrics, fault_hook)
        self.secret = auth.check_secret(secret)
        # address -> handshaken receiver, and how its ranks take ours (another width)
        self._peers: dict[str, tuple[ReceiverCore, HeadMap | None]] = {}

    def _peer(self, address: str) -> tuple[ReceiverCore, HeadMap | None]:
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None:
            return peer
        with _registry_lock:
            receiver = _registry.get(address)
        if receiver is None:
            raise TransferError("unreachable", f"no in-process receiver at {address}")
        problem = receiver.core.handshake(self.fingerprint) or auth.local_problem(
            self.secret, receiver.secret
        )
        if problem:
            raise HandshakeError(problem)
        peer = receiver.core, receiver.core.fingerprint.head_map(self.fingerprint)
        with self._lock:
            self._peers[address] = peer
        return peer

    def _transmit(self, out: Outgoing, header: MessageHeader) -> None:
        try:
            core, heads = self._peer(out.destination.address)
        except TransferError as exc:
            self._finish(out, exc)
            return
        fill = functools.partial(self._read, core, header, heads)
        status = core.deliver(header, self, fill, heads)
        if status is not None:
            self._settle(out, status)

    def _read(self, core: ReceiverCore, header: MessageHeader, heads: HeadMap | None) -> int:
        layers = (header.layer_start, header.layer_end)
        src, dst = header.src_block_ids, header.dst_block_ids
        if heads is not None:
            heads.copy(core.kv, self.kv[layers[0] : layers[1]], src, dst, layers)
            return checksum_blocks(self.kv, src, layers)
        return copy_blocks(
            core.kv,
            self.kv.data_ptr(),
            self.kv.shape[2],
            src,
            dst,
            layers,
        )

    def _notify_abort(self, out: Outgoing) -> None:
        with self._lock:
            peer = self._peers.get(out.destination.address)
        if peer is not None:
            peer[0].sender_abort(out.request_id, source=self)

    def close(self) -> None:
        self._fail_all(TransferError("closed", "sender closed"))
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for core, _ in peers:
            core.source_lost(self)
