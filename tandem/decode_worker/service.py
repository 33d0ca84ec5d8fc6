"""DecodeWorker gRPC service: one Decode stream is one request, from reservation to last token."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from tandem import logs
from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.sequence import FinishReason
from tandem.errors import InvalidRequestError, OutOfBlocksError
from tandem.kv_transfer import TransferError
from tandem.wire import finish_to_proto, logprob_to_proto
from tandem.worker.request import parse_request

if TYPE_CHECKING:
    from tandem.decode_worker.server import DecodeServer

log = logging.getLogger(__name__)


def _chunk(out: RequestOutput, first_token_sent: bool = False) -> worker_pb2.DecodeResponse:
    # The admitted first token was streamed by the prefill worker: never again here.
    tokens, text = ([], "") if first_token_sent else (out.token_ids, out.text)
    return worker_pb2.DecodeResponse(
        chunk=worker_pb2.TokenChunk(
            token_ids=tokens,
            text=text,
            finish_reason=finish_to_proto(out.finish_reason if out.finished else None),
            completion_tokens=out.num_output_tokens,
            logprobs=[logprob_to_proto(lp) for lp in out.logprobs or ()] if tokens else [],
        )
    )


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, server: DecodeServer) -> None:
        self.server = server
        self._active: set[str] = set()  # request ids in this worker (event loop thread)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        server = self.server
        loop, admission = server.loop, server.admission
        logs.request_id.set(request.request.request_id)  # this handler's log lines carry it
        if server.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"decode worker {server.worker_id} is draining"
            )
        await loop.ended(request.request.request_id)  # an earlier call's, cancelled
        try:
            req = parse_request(request.request, server.engine)
            if req.request_id in self._active:
                raise InvalidRequestError(
                    "request_id", f"request_id {req.request_id!r} is already running"
                )
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = req.request_id
        if request.prefill_here:
            async for response in self._prefill_here(req, context, request.prompt_whole):
                yield response
            return
        self._active.add(rid)
        outputs = loop.subscribe(rid)  # before admission, so no step output is missed
        admitted: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        try:
            try:
                dest = await loop.call(lambda e: admission.reserve(e, req, admitted))
            except (OutOfBlocksError, InvalidRequestError) as exc:
                await self._refuse(context, exc)
            yield worker_pb2.DecodeResponse(
                destination=worker_pb2.KvDestination(
                    address=dest.address,
                    request_id=rid,
                    block_ids=dest.block_ids,
                    lease_seconds=admission.lease_s,
                    skip_blocks=dest.skip_blocks,
                    block_size=self.server.engine.kv.block_size,
                )
            )
            try:
                out = await admitted
            except TransferError as exc:
                # ABORTED, not UNAVAILABLE: this worker is fine, the KV did not come.
                await context.abort(
                    grpc.StatusCode.ABORTED, f"KV of request {rid} did not arrive: {exc}"
                )
            if out.finished:  # the first token ended it (the prefill side normally says so)
                self._count(out)
                yield _chunk(out, first_token_sent=True)
            while not out.finished:
                out = await outputs.get()
                if out.finished:
                    self._count(out)
                yield _chunk(out)
        finally:
            loop.end(rid, lambda e: admission.end(e, rid))
            self._active.discard(rid)

    async def _refuse(self, context, exc: OutOfBlocksError | InvalidRequestError) -> None:
        """A reservation the engine refused. Its request id still known there, though no
        handler has it, is an earlier request's whose blocks wait for a KV read still
        running into them (admission.py): ALREADY_EXISTS, for a retry later. Not
        RESOURCE_EXHAUSTED: the router would queue it for room, ahead of the rest."""
        if isinstance(exc, OutOfBlocksError):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker {self.server.worker_id}: {exc}"
            )
        if exc.field == "request_id":
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"decode worker {self.server.worker_id}: {exc} (the KV of an earlier request "
                f"with this id is still being released); retry later",
            )
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _prefill_here(
        self, req, context, prompt_whole: bool = False
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """The request runs here from its prefill on: no KV to wait for, no lease. The
        first chunk carries the first token, sampled here. ``prompt_whole``: see
        ``LLMEngine.prefill_here``."""
        server = self.server
        loop, rid = server.loop, req.request_id
        self._active.add(rid)
        outputs = loop.subscribe(rid)
        # Whether the engine's request with this id is this handler's: set on the engine
        # thread, so the abort queued behind it in ``finally`` sees it even when this
        # handler was cancelled before it heard back.
        owned: list[bool] = []

        def start(e: LLMEngine) -> list[int]:
            blocks = e.prefill_here(
                req.prompt_ids, req.params, rid, req.output_ids, cache_salt=req.cache_salt,
                prompt_whole=prompt_whole,
            )  # fmt: skip
            owned.append(True)
            return blocks

        try:
            try:
                blocks = await loop.call(start)
            except (OutOfBlocksError, InvalidRequestError) as exc:
                await self._refuse(context, exc)
            server.prefilled_here += 1
            yield worker_pb2.DecodeResponse(
                destination=worker_pb2.KvDestination(request_id=rid, block_ids=blocks)
            )
            while True:
                out = await outputs.get()
                if out.finished:
                    self._count(out)
                yield _chunk(out)
                if out.finished:
                    return
        finally:
            loop.end(rid, lambda e: owned and e.abort(rid))
            self._active.discard(rid)

    def _count(self, out: RequestOutput) -> None:
        """A request served, counted before its last chunk is sent: the router cancels
        the stream as soon as it has that chunk, which may end this handler at the yield."""
        if out.finish_reason is not FinishReason.ERROR:
            self.server.served += 1

    async def RenewLease(self, request, context) -> worker_pb2.RenewLeaseResponse:
        server = self.server
        renewed = server.receiver.renew(request.request_id, server.admission.lease_s)
        return worker_pb2.RenewLeaseResponse(renewed=renewed)

    async def Status(self, request, context) -> worker_pb2.WorkerStatus:
        if self.server.draining:  # out of placement until it has gone (router: down)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        return self.server.status()
