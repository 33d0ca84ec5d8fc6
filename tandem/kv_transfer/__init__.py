"""KV transfer between the prefill and decode pools.

base.py      the contract: states, errors, fingerprint, sender/receiver interfaces
payload.py   gather/scatter of a request's blocks, message header, checksum
receiver.py  reservations and their state machine, shared by every backend
sender.py    request bookkeeping and message building, shared by every backend
inproc.py    same-process backend (tests, colocated mode)
ucx/         UCX backend (ucxx) for separate processes and machines

Pick a backend by name with ``make_sender`` / ``make_receiver``.
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
    """options: metrics, fault_hook; ucx also connect_timeout_s, ack_timeout_s."""
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
    """options: metrics, max_request_blocks (the largest reservation ``expect`` takes, and
    so the bound on staging for late data; default: the whole pool); inproc also name;
    ucx also handshake_timeout_s, sweep_interval_s.

    ``host``/``port`` only matter for ucx (port 0: any free port; see ``.address``).
    """
    _check(backend)
    if backend == "inproc":
        from tandem.kv_transfer.inproc import InProcReceiver

        return InProcReceiver(kv, fingerprint, **options)
    from tandem.kv_transfer.ucx.receiver import UcxReceiver

    return UcxReceiver(kv, fingerprint, host=host, port=port, **options)
