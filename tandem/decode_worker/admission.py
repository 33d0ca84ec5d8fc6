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
    def __init__(self, receiver: KVReceiver, lease_s: float) -> None:
        self.receiver = receiver
        self.lease_s = lease_s
        self._waiting: dict[str, _Waiting] = {}

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
            req.prompt_ids, req.params, rid, req.output_ids
        )
        try:
            dest = self.receiver.expect(rid, block_ids[cached:], self.lease_s)
        except Exception:
            engine.abort(rid)
            raise
        self._waiting[rid] = _Waiting(admitted, admitted.get_loop())
        return dataclasses.replace(dest, skip_blocks=cached)

    def poll(self, engine: LLMEngine) -> None:
        """The EngineLoop hook: admit what arrived, fail what cannot arrive."""
        for rid in list(self._waiting):
            status = self.receiver.poll(rid)
            if status.state is TransferState.DONE:
                w = self._waiting.pop(rid)
                self.receiver.release(rid)
                try:
                    out = engine.admit(rid, status.first_token)
                except Exception as exc:  # fail this request only, not the engine thread
                    log.exception("admitting %s failed", rid)
                    engine.abort(rid)
                    _resolve(w, TransferError("admit failed", f"admitting failed: {exc}"))
                    continue
                _resolve(w, out)
            elif status.state is TransferState.FAILED:
                w = self._waiting.pop(rid)
                self.receiver.release(rid)  # drained: nothing more is written
                engine.abort(rid)
                detail = f": {status.detail}" if status.detail else ""
                _resolve(w, TransferError(status.reason, f"{status.reason}{detail}"))

    def end(self, engine: LLMEngine, rid: str) -> None:
        """The stream is over, whatever the reason: stop writes, then free the blocks."""
        self._waiting.pop(rid, None)
        self.receiver.release(rid)
        engine.abort(rid)

    def end_all(self, engine: LLMEngine) -> None:
        for rid in list(self._waiting):
            self.end(engine, rid)
        engine.abort_all()
