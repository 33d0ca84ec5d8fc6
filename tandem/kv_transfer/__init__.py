"""KV transfer between the prefill and decode pools.

base.py      the contract: states, errors, fingerprint, sender/receiver interfaces
auth.py      the shared-secret handshake: nonces, proofs, which side lacks a secret
payload.py   the message header, checksums and copies of blocks read in place
receiver.py  reservations and their state machine, shared by every backend
sender.py    request bookkeeping and message building, shared by every backend
inproc.py    same-process backend (tests)
ucx/         UCX backend (ucxx) for separate processes and machines: the decode worker
             reads a request's blocks straight out of the prefill worker's cache
             (ucx/rma.py): no gather, staging or scatter copy
heads.py     KV between tensor-parallel workers of different widths: heads re-split

Pick a backend by name with ``make_sender`` / ``make_receiver``.

Security. KV bytes travel UNENCRYPTED over the KV fabric, as with NIXL and
Mooncake: anyone who can watch that network can read prompts' KV, and anyone
who can sit in the middle of a connection can change it. The shared secret
(``secret``, at least 16 bytes, the same on every worker of a cluster) only
authenticates the two ends: a stranger can neither write into a decode worker's
blocks nor get a prefill worker to send it a prompt's KV. So keep the KV
network trusted, and bind the listener to that network's interface (the decode
worker's ``host``), never to every interface of a machine on a wider network.
The prefill worker's whole cache is open to remote reads, and the key to it goes
to each authenticated decode worker over the same unencrypted connection: a
watcher of the KV network could read that cache.
``secret=None`` turns authentication off: for tests and loopback-only setups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.kv_transfer.base import (
    Destination,
    Fingerprint,
    HandshakeError,
    KVReceiver,
    KVSender,
    TransferError,
    TransferMetrics,
    TransferState,
    TransferStatus,
)

if TYPE_CHECKING:
    import torch

BACKENDS = ("ucx", "inproc")

__all__ = [
    "BACKENDS",
    "Destination",
    "Fingerprint",
    "HandshakeError",
    "KVReceiver",
    "KVSender",
    "TransferError",
    "TransferMetrics",
    "TransferState",
    "TransferStatus",
    "make_receiver",
    "make_sender",
]


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        known = ", ".join(BACKENDS)
        raise ValueError(f"kv transfer backend must be one of {known}, got {backend!r}")


def make_sender(
    backend: str, kv: torch.Tensor, fingerprint: Fingerprint, **options: Any
) -> KVSender:
    """options: metrics, fault_hook, secret; ucx also connect_timeout_s, ack_timeout_s."""
    _check(backend)
    if backend == "inproc":
        from tandem.kv_transfer.inproc import InProcSender

        return InProcSender(kv, fingerprint, **options)
    from tandem.kv_transfer.ucx.sender import UcxSender

    return UcxSender(kv, fingerprint, **options)


def make_receiver(
    backend: str,
    kv: torch.Tensor,
    fingerprint: Fingerprint,
    host: str = "127.0.0.1",
    port: int = 0,
    **options: Any,
) -> KVReceiver:
    """options: metrics, secret, max_request_blocks (the largest reservation ``expect``
    takes; default: the whole pool); inproc also name; ucx also handshake_timeout_s,
    sweep_interval_s, map_peers.

    ``host``/``port`` only matter for ucx (port 0: any free port; see ``.address``); the
    listener accepts connections to ``host`` only ("0.0.0.0": every interface).
    """
    _check(backend)
    if backend == "inproc":
        from tandem.kv_transfer.inproc import InProcReceiver

        return InProcReceiver(kv, fingerprint, **options)
    from tandem.kv_transfer.ucx.receiver import UcxReceiver

    return UcxReceiver(kv, fingerprint, host=host, port=port, **options)
