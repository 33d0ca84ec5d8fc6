"""The sending half shared by every backend: request bookkeeping and message building.

A request's path on the prefill side:

    send_layers(dest, src, (0, 8))     checksum layers 0-7 of the src blocks where they
    send_layers(dest, src, (8, 16))    lie, hand the header to the transport; no
    ...                                confirmation
    send(dest, src, first_token)       the layers not yet sent (possibly none) go out with
      -> Future                        the first token on the *final* message
    receiver reads the blocks out of   future -> TransferStatus(DONE) or TransferError(reason)
    this cache, acks the final message then, and only then, the caller frees its blocks

No payload is built: the receiver reads the blocks in place (ucx/rma.py; in one
process, inproc.py), so they must not change until the request's future is done.
A header's checksum is taken when it is built, in the caller's thread: with
layer-wise sending right after the layer is computed, while it is in cache.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from tandem.kv_transfer.base import (
    GIVEN_UP,
    Destination,
    Fingerprint,
    HandshakeError,
    KVSender,
    TransferError,
    TransferMetrics,
    TransferState,
    TransferStatus,
)
from tandem.kv_transfer.payload import MessageHeader, block_bytes, make_header

log = logging.getLogger(__name__)

# Test-only fault injection: called with each message after its checksum was taken,
# with the first source block, which it may change in place (to prove that
# corruption is caught).
FaultHook = Callable[[MessageHeader, torch.Tensor], None]
_ABORTED_MEMORY = 4096


@dataclass(eq=False)
class Outgoing:
    """One request on its way out."""

    destination: Destination
    src_block_ids: tuple[int, ...]
    sent: list[bool]  # layer i handed to the transport
    future: Future[TransferStatus] = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    final_sent: bool = False
    final_at: float | None = None  # when the final message was handed over (ack deadline)

    @property
    def request_id(self) -> str:
        return self.destination.request_id


def _ranges(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of False in ``flags`` as [start, end) ranges."""
    out: list[tuple[int, int]] = []
    for i, done in enumerate(flags):
        if done:
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class SenderBase(KVSender):
    # A message carries at most this much KV (whole layers; one layer may be more): a
    # large request goes as several, so the receiver reads one while the next is built.
    max_message_bytes = 64 << 20

    def __init__(
        self,
        kv: torch.Tensor,  # [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]
        fingerprint: Fingerprint,
        metrics: TransferMetrics | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [layers, 2, blocks + 1, ...], got {list(kv.shape)}")
        self.kv = kv
        self._block_bytes = block_bytes(kv)
        self.fingerprint = fingerprint
        # A tensor-parallel cache is its ranks' layers one rank after another; a message
        # holds one rank's (a receiver of another width re-splits each rank's heads).
        self._rank_layers = kv.shape[0]
        if fingerprint.tensor_parallel_size > 1:
            self._rank_layers = fingerprint.num_layers
            if kv.shape[0] != fingerprint.tensor_parallel_size * fingerprint.num_layers:
                raise ValueError(
                    f"kv holds {kv.shape[0]} layers, not {fingerprint.tensor_parallel_size} "
                    f"ranks x {fingerprint.num_layers}"
                )
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.fault_hook = fault_hook
        self._lock = threading.Lock()  # guards _requests and metrics
        self._requests: dict[str, Outgoing] = {}
        # Recently aborted ids: a prefill thread still calling send_layers for one of
        # them must not start a fresh request. Bounded; oldest forgotten first.
        self._aborted: OrderedDict[str, None] = OrderedDict()

    # --- public API ----------------------------------------------------------------

    def send_layers(
        self, destination: Destination, src_block_ids: Sequence[int], layers: tuple[int, int]
    ) -> None:
        out, _ = self._open(destination, src_block_ids, (layers,), final=False)
        if out is None:
            return  # the request already failed or was aborted; its future says why
        for chunk in self._chunks(out, [layers]):
            self._transmit(out, self._header(out, chunk, final=False))

    def send(
        self,
        destination: Destination,
        src_block_ids: Sequence[int],
        first_token: int,
        layers: tuple[int, int] | None = None,
    ) -> Future[TransferStatus]:
        ranges = None if layers is None else (layers,)
        out, todo = self._open(destination, src_block_ids, ranges, final=True)
        if out is None:
            return self._requests_done_future(destination.request_id)
        if not todo:  # everything went out with send_layers: a final message with no KV
            todo = [(len(out.sent), len(out.sent))]
        chunks = self._chunks(out, todo)
        # Each message goes as soon as it is built: its checksum is the slow part, and
        # the receiver reads one chunk while the next is being checksummed here.
        for chunk in chunks[:-1]:
            self._transmit(out, self._header(out, chunk, final=False))
        self._transmit(out, self._header(out, chunks[-1], True, first_token))
        return out.future

    def abort(self, request_id: str) -> None:
        with self._lock:
            out = self._requests.get(request_id)
            self._remember_abort(request_id)
        if out is None:
            return
        # Its owner gave it up (its call ended): not a transfer failure.
        error = TransferError("aborted", f"request {request_id} aborted by sender")
        self._finish(out, error, failure=False)
        self._notify_abort(out)

    def forget(self, request_id: str) -> None:
        """A new request with an aborted one's id starts (its owner has ended the old
        one, so no late ``send_layers`` for it can come): the id may send again."""
        with self._lock:
            self._aborted.pop(request_id, None)

    def _remember_abort(self, request_id: str) -> None:
        self._aborted[request_id] = None
        while len(self._aborted) > _ABORTED_MEMORY:
            self._aborted.popitem(last=False)

    def _chunks(self, out: Outgoing, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` cut into layer ranges of at most ``max_message_bytes`` each (at
        least one layer) and of one rank each, in order; an empty range stays as it is."""
        step = max(1, self.max_message_bytes // (2 * len(out.src_block_ids) * self._block_bytes))
        per_rank = self._rank_layers
        chunks = []
        for l0, l1 in ranges:
            if l1 == l0:
                chunks.append((l0, l1))
            start = l0
            while start < l1:
                end = min(start + step, l1, (start // per_rank + 1) * per_rank)
                chunks.append((start, end))
                start = end
        return chunks

    # --- for backends --------------------------------------------------------------

    @abc.abstractmethod
    def _transmit(self, out: Outgoing, header: MessageHeader) -> None:
        """Hand one message to the transport, after those before it; never blocks on the
        network."""

    def _notify_abort(self, out: Outgoing) -> None:
        """Tell the receiver that ``out`` was aborted (best effort)."""

    def _finish(
        self, out: Outgoing, result: TransferStatus | TransferError, failure: bool = True
    ) -> None:
        """Resolve a request once (later calls are ignored) and count it (an error with
        ``failure`` False, its owner's abort, is not counted)."""
        with self._lock:
            if self._requests.get(out.request_id) is not out:
                return
            del self._requests[out.request_id]
            if isinstance(result, TransferError):
                if failure:
                    self.metrics.record_failure(result.reason)
            else:
                self.metrics.record_done(time.monotonic() - out.started, sent=out.nbytes)
        try:  # its owner may cancel it on another thread at any moment, this one included
            if isinstance(result, TransferError):
                out.future.set_exception(result)
            else:
                out.future.set_result(result)
        except InvalidStateError:  # cancelled: nobody waits for the outcome
            return
        if isinstance(result, TransferError) and failure:
            log.warning("KV transfer %s failed: %s", out.request_id, result,
                        extra={"request_id": out.request_id})  # fmt: skip

    def _fail_all(self, error: TransferError, address: str | None = None) -> int:
        """Fail every unfinished request (to ``address`` only, if given); returns how many."""
        with self._lock:
            doomed = [
                o
                for o in self._requests.values()
                if address is None or o.destination.address == address
            ]
        for out in doomed:
            copy = (
                HandshakeError(str(error))
                if isinstance(error, HandshakeError)
                else TransferError(error.reason, str(error))
            )
            self._finish(out, copy)
        return len(doomed)

    def _settle(self, out: Outgoing, ack: TransferStatus) -> None:
        """Resolve ``out`` as the receiver's final ack says. A reservation that its owner
        gave up (the request ended on the decode side) is not a transfer failure."""
        if ack.state is TransferState.DONE:
            seconds = time.monotonic() - out.started
            self._finish(out, TransferStatus(TransferState.DONE, bytes=out.nbytes, seconds=seconds))
            return
        detail = f": {ack.detail}" if ack.detail else ""
        error = TransferError(ack.reason or "failed", f"{ack.reason}{detail}")
        self._finish(out, error, failure=ack.reason != GIVEN_UP)

    # --- internals -----------------------------------------------------------------

    def _open(
        self,
        dest: Destination,
        src_block_ids: Sequence[int],
        ranges: tuple[tuple[int, int], ...] | None,
        final: bool,
    ) -> tuple[Outgoing | None, list[tuple[int, int]]]:
        """Find or start the request's record and claim ``ranges`` (None: every layer not
        yet sent). Returns the record (None if the request is over) and the claimed ranges.
        """
        src = tuple(int(b) for b in src_block_ids)
        num_layers, num_blocks = self.kv.shape[0], self.kv.shape[2] - 1
        bad = [b for b in src if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"source block ids {bad} outside the pool of {num_blocks} blocks")
        if not src or len(src) > len(dest.block_ids):
            raise ValueError(
                f"{len(src)} source blocks for {len(dest.block_ids)} destination blocks"
            )
        for l0, l1 in ranges or ():
            if not 0 <= l0 < l1 <= num_layers:
                raise ValueError(f"layer range [{l0}, {l1}) not within [0, {num_layers})")
        with self._lock:
            out = self._requests.get(dest.request_id)
            if dest.request_id in self._aborted:
                return None, []
            if out is None:
                out = Outgoing(dest, src, [False] * num_layers)
                self._requests[dest.request_id] = out
                out.future.add_done_callback(self._on_future_done)
            elif out.destination != dest or out.src_block_ids != src:
                raise ValueError(f"request {dest.request_id!r} is already sending elsewhere")
            if out.final_sent:
                raise ValueError(f"request {dest.request_id!r} already sent its final message")
            for l0, l1 in ranges or ():
                if any(out.sent[l0:l1]):
                    raise ValueError(f"layers [{l0}, {l1}) of {dest.request_id!r} already sent")
            claimed = list(ranges) if ranges is not None else _ranges(out.sent)
            for l0, l1 in claimed:
                out.sent[l0:l1] = [True] * (l1 - l0)
            if final:
                out.final_sent, out.final_at = True, time.monotonic()
        return (None, []) if out.future.done() else (out, claimed)

    def _header(
        self,
        out: Outgoing,
        layers: tuple[int, int],
        final: bool,
        first_token: int | None = None,
    ) -> MessageHeader:
        dst = out.destination.block_ids[: len(out.src_block_ids)]
        header = make_header(
            out.request_id,
            layers,
            out.src_block_ids,
            dst,
            self.kv,
            first_token,
            final,
        )
        if header.nbytes and self.fault_hook is not None:
            self.fault_hook(header, self.kv[layers[0], 0, out.src_block_ids[0]])
        out.nbytes += header.nbytes
        return header

    def _requests_done_future(self, request_id: str) -> Future[TransferStatus]:
        fut: Future[TransferStatus] = Future()
        fut.set_exception(TransferError("aborted", f"request {request_id} was aborted"))
        return fut

    def _on_future_done(self, future: Future[TransferStatus]) -> None:
        # A caller that cancels the future means "abort".
        if future.cancelled():
            with self._lock:
                out = next((o for o in self._requests.values() if o.future is future), None)
                if out is not None:
                    self._requests.pop(out.request_id, None)
                    self._remember_abort(out.request_id)
            if out is not None:
                self._notify_abort(out)
