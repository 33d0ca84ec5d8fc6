"""Reservations waiting for their KV, admitted to the batch when it has arrived.

Everything here runs on the engine thread (``reserve`` and ``end`` through
``EngineLoop.call``/``submit``, ``poll`` as an EngineLoop hook), so it needs no
locks; the outcome of each reservation reaches the gRPC handler through an
asyncio future of the handler's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.kv_transfer import Destination, KVReceiver, TransferError, TransferState
from tandem.worker.request import WorkRequest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Waiting:
    # Resolves to the admitted first token's RequestOutput, or raises TransferError.
    admitted: asyncio.Future[RequestOutput]
    loop: asyncio.AbstractEventLoop


def _resolve(w: _Waiting, result: RequestOutput | Exception) -> None:
    def set_it() -> None:
        if w.admitted.done():  # the handler went away (cancelled)
            return
        if isinstance(result, Exception):
            w.admitted.set_exception(result)
        else:
            w.admitted.set_result(result)

    try:
        w.loop.call_soon_threadsafe(set_it)
    except RuntimeError:  # the handler's event loop is closed
        pass


class KvAdmission:
    """A request whose KV is not to be admitted (failed, or its stream over) gives its
    blocks back only once no read runs into them. Such a read (a slow or stalled
    peer, up to the transport's read timeout) is not waited for on the engine thread,
    where it would stall every stream of this worker: the request is parked in
    ``_draining``, its reservation failed so that no new read starts, and each poll
    tries again."""

    def __init__(self, receiver: KVReceiver, lease_s: float) -> None:
        self.receiver = receiver
        self.lease_s = lease_s
        self._waiting: dict[str, _Waiting] = {}
        self._draining: set[str] = set()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def reserve(
        self, engine: LLMEngine, req: WorkRequest, admitted: asyncio.Future[RequestOutput]
    ) -> Destination:
        """Blocks for the request (``LLMEngine.reserve``) under a lease; the destination
        names those the transfer fills (not the prompt's first blocks this worker has
        cached, which ``Destination.skip_blocks`` counts). Raises OutOfBlocksError."""
        rid = req.request_id
        block_ids, cached = engine.reserve_for_transfer(
            req.prompt_ids, req.params, rid, req.output_ids, cache_salt=req.cache_salt
        )
        try:
            dest = self.receiver.expect(rid, block_ids[cached:], self.lease_s)
        except Exception:
            engine.abort(rid)
            raise
        self._waiting[rid] = _Waiting(admitted, admitted.get_loop())
        return dataclasses.replace(dest, skip_blocks=cached)

    def poll(self, engine: LLMEngine) -> None:
        """The EngineLoop hook: admit what arrived, fail what cannot arrive, free what
        has drained."""
        for rid in list(self._draining):
            self._free(engine, rid)
        for rid in list(self._waiting):
            status = self.receiver.poll(rid, drain=False)
            if status.state is TransferState.DONE:
                w = self._waiting.pop(rid)
                self.receiver.release(rid)
                try:
                    out = engine.admit(rid, status.first_token)
                except Exception as exc:  # fail this request only, not the engine thread
                    log.exception("admitting %s failed", rid, extra={"request_id": rid})
                    engine.abort(rid)
                    _resolve(w, TransferError("admit failed", f"admitting failed: {exc}"))
                    continue
                _resolve(w, out)
            elif status.state is TransferState.FAILED:
                w = self._waiting.pop(rid)
                self._free(engine, rid)
                detail = f": {status.detail}" if status.detail else ""
                _resolve(w, TransferError(status.reason, f"{status.reason}{detail}"))

    def end(self, engine: LLMEngine, rid: str) -> None:
        """The stream is over, whatever the reason: stop writes, then free the blocks."""
        self._waiting.pop(rid, None)
        self._free(engine, rid)

    def _free(self, engine: LLMEngine, rid: str) -> None:
        """The blocks back to the engine once no read runs into them; else parked."""
        if self.receiver.release(rid, wait=False):
            self._draining.discard(rid)
            engine.abort(rid)
        elif rid not in self._draining:
            log.info("KV of %s: a read still runs into its blocks; freed once it ends", rid,
                     extra={"request_id": rid})  # fmt: skip
            self._draining.add(rid)

    def end_all(self, engine: LLMEngine) -> None:
        """Shutting down: fails every reservation and frees everything. A read still
        running into some blocks is not waited for here, on the engine thread (up to the
        transport's read timeout: the stop would take the engine for hung); no request
        can take the blocks any more, and the receiver's close, next, waits for it."""
        for rid in [*self._waiting, *self._draining]:
            self.receiver.release(rid, wait=False)
        self._waiting.clear()
        self._draining.clear()
        engine.abort_all()
