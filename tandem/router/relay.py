"""One request's trip through the pools, relayed to the client as one stream.

1. Pick a decode worker and open ``Decode``; its first message is the
   ``KvDestination`` (blocks reserved for prompt + max_tokens). If the worker
   has no room (RESOURCE_EXHAUSTED) or is gone (UNAVAILABLE), one other decode
   worker is tried; nothing was computed yet, so the retry is safe.
2. Pick a prefill worker and call ``Prefill(request, destination)``. It returns
   the first token, which goes to the client at once (time to first token). If
   that token ends the request, the response carries finish_reason and usage and
   the decode stream is cancelled. A prefill worker that is gone or busy
   (UNAVAILABLE, RESOURCE_EXHAUSTED) is replaced by one other. That is safe even
   if the first one got some KV out before it failed: a decode worker takes a
   reservation's KV from one sender only and answers any other "another
   sender", so the retry then fails (ABORTED) instead of delivering twice.
   ABORTED means the KV transfer to the decode worker failed: the request fails
   as UNAVAILABLE and the prefill worker is not blamed.
3. Relay the decode stream's chunks in order. The decode worker never resends
   the first token, so nothing is duplicated; its last chunk has finish_reason.

Every worker call carries the client's remaining deadline. However the stream
ends (finished, failed, client cancel or deadline), both worker calls are
cancelled in ``finally``, so the workers free their blocks. A call that fails as
a dead worker does marks that worker down at once: no new request goes to it
until it answers ``Status`` again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.router.errors import RouterError
from tandem.router.frontend import PreparedRequest
from tandem.router.placement import PlacementPolicy, Pool
from tandem.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

Code = grpc.StatusCode
# Codes after which another worker of the pool may take the request: nothing was
# computed (decode) or nothing reached the reservation (prefill).
_RETRY_OPEN = (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE)
# Codes that mean the worker process (or our link to it) is gone. CANCELLED here
# was not our doing (ours arrives as asyncio.CancelledError): the server went away.
_DEAD = (Code.UNAVAILABLE, Code.CANCELLED)


class Relay:
    def __init__(self, registry: WorkerRegistry, policy: PlacementPolicy) -> None:
        self.registry = registry
        self.policy = policy
        self._active: set[str] = set()  # request ids in flight

    async def generate(
        self, req: PreparedRequest, timeout: float | None
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """``timeout``: the client's remaining time in seconds (None: no deadline)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if req.request_id in self._active:
            # Workers key KV reservations and transfers by request id.
            raise RouterError(
                Code.ALREADY_EXISTS, f"request_id {req.request_id!r} is already in flight"
            )
        if not self.registry.placeable(Pool.PREFILL):
            raise self._none_available(Pool.PREFILL)
        worker_req = wire.worker_request(req.request_id, req.prompt_ids, req.params)
        self._active.add(req.request_id)
        try:
            # aclosing: a stream closed early must run the inner finally (cancel, release) now.
            async with aclosing(self._run(req, worker_req, deadline)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._active.discard(req.request_id)

    async def _run(
        self, req: PreparedRequest, worker_req: worker_pb2.WorkerRequest, deadline: float | None
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        decode, stream, destination = await self._open_decode(worker_req, deadline)
        try:
            prefill = worker_pb2.PrefillRequest(request=worker_req, destination=destination)
            first = _first_response(prefill, await self._prefill(prefill, deadline))
            yield first
            if first.finish_reason:
                return
            async with aclosing(self._relay_decode(req, decode, stream)) as responses:
                async for response in responses:
                    yield response
        finally:
            stream.cancel()  # no-op once finished; otherwise the worker frees its blocks
            self.registry.release(decode)

    async def _open_decode(
        self, worker_req: worker_pb2.WorkerRequest, deadline: float | None
    ) -> tuple[Worker, grpc.aio.UnaryStreamCall, worker_pb2.KvDestination]:
        tried: list[Worker] = []
        error: RouterError | None = None
        for _ in range(2):
            candidates = self.registry.placeable(Pool.DECODE, exclude=tried)
            if not candidates:
                break
            worker = self._pick(Pool.DECODE, candidates)
            tried.append(worker)
            timeout = _remaining(deadline)
            self.registry.acquire(worker)
            request = worker_pb2.DecodeRequest(request=worker_req)
            stream = worker.stub.Decode(request, timeout=timeout)
            try:
                first = await stream.read()
            except grpc.aio.AioRpcError as exc:
                self.registry.release(worker)
                error = self._failed(worker, exc)
                if exc.code() in _RETRY_OPEN:
                    log.info("request %s: %s", worker_req.request_id, error.message)
                    continue
                raise error from None
            except BaseException:
                stream.cancel()
                self.registry.release(worker)
                raise
            if first is grpc.aio.EOF or not first.HasField("destination"):
                stream.cancel()
                self.registry.release(worker)
                raise RouterError(
                    Code.INTERNAL,
                    f"decode worker {worker.address} did not open its stream with a KvDestination",
                )
            self.registry.reserved(worker, len(first.destination.block_ids))
            return worker, stream, first.destination
        raise error or self._none_available(Pool.DECODE)

    async def _prefill(
        self, request: worker_pb2.PrefillRequest, deadline: float | None
    ) -> worker_pb2.PrefillResponse:
        tried: list[Worker] = []
        while True:
            candidates = self.registry.placeable(Pool.PREFILL, exclude=tried)
            if not candidates:
                raise self._none_available(Pool.PREFILL)
            worker = self._pick(Pool.PREFILL, candidates)
            tried.append(worker)
            timeout = _remaining(deadline)
            self.registry.acquire(worker)
            call = worker.stub.Prefill(request, timeout=timeout)
            try:
                return await call
            except grpc.aio.AioRpcError as exc:
                if exc.code() is Code.ABORTED:  # the KV never reached the decode worker
                    raise RouterError.unavailable(
                        f"KV transfer from prefill worker {worker.address} to decode worker "
                        f"{request.destination.address} failed: {exc.details()}"
                    ) from None
                error = self._failed(worker, exc)
                # Gone or busy: one other worker may serve the reservation (see above).
                if exc.code() in _RETRY_OPEN and len(tried) < 2:
                    log.info("request %s: %s", request.request.request_id, error.message)
                    continue
                raise error from None
            finally:
                if not call.done():
                    call.cancel()
                self.registry.release(worker)

    async def _relay_decode(
        self, req: PreparedRequest, worker: Worker, stream: grpc.aio.UnaryStreamCall
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        relayed = 1  # the first token, from prefill
        while True:
            try:
                message = await stream.read()
            except grpc.aio.AioRpcError as exc:
                raise self._failed(worker, exc) from None
            if message is grpc.aio.EOF:
                raise RouterError.unavailable(
                    f"decode worker {worker.address} ended the stream before the request finished"
                )
            if not message.HasField("chunk"):
                raise RouterError(
                    Code.INTERNAL, f"decode worker {worker.address} sent a second KvDestination"
                )
            chunk = message.chunk
            relayed += len(chunk.token_ids)
            response = tandem_pb2.GenerateResponse(
                request_id=req.request_id, text=chunk.text, token_ids=chunk.token_ids
            )
            if chunk.finish_reason:
                response.finish_reason = chunk.finish_reason
                response.usage.prompt_tokens = len(req.prompt_ids)
                # The worker's count includes tokens it held back (a stop string).
                response.usage.completion_tokens = chunk.completion_tokens or relayed
                yield response
                return
            yield response

    def _pick(self, pool: Pool, candidates: list[Worker]) -> Worker:
        by_address = {w.address: w for w in candidates}
        return by_address[self.policy.pick(pool, [w.load() for w in candidates]).address]

    def _failed(self, worker: Worker, exc: grpc.aio.AioRpcError) -> RouterError:
        """The client's status for a failed worker call; a dead worker is marked down."""
        code, details = exc.code(), exc.details()
        where = f"{worker.pool.value} worker {worker.address}"
        if code in _DEAD:
            self.registry.mark_down(worker, f"{code.name}: {details}")
            return RouterError.unavailable(f"{where} is unavailable: {details}")
        if code is Code.DEADLINE_EXCEEDED:
            return RouterError(code, f"the deadline passed while waiting for {where}")
        return RouterError(code, f"{where}: {details}")

    def _none_available(self, pool: Pool) -> RouterError:
        total = len(self.registry.workers(pool))
        why = f"all {total} registered are down" if total else "none is registered"
        return RouterError.unavailable(f"no {pool.value} worker is available ({why})")


def _first_response(
    request: worker_pb2.PrefillRequest, result: worker_pb2.PrefillResponse
) -> tandem_pb2.GenerateResponse:
    """The client's first response: the prefill's token, and usage if it ended the request."""
    response = tandem_pb2.GenerateResponse(
        request_id=request.request.request_id,
        text=result.text,
        token_ids=[result.first_token_id],
    )
    if result.finish_reason:
        response.finish_reason = result.finish_reason
        response.usage.prompt_tokens = len(request.request.prompt_token_ids)
        response.usage.completion_tokens = 1
    return response


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RouterError(Code.DEADLINE_EXCEEDED, "the deadline passed before the call was made")
    return left
