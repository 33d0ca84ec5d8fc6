"""PrefillWorker gRPC service: one Prefill call is one request's prompt and KV transfer.

    Prefill   over ``max_queue`` calls in this worker -> RESOURCE_EXHAUSTED at once
              request and destination checked (INVALID_ARGUMENT) -> engine queue
              -> prefill step: after each layer, that layer's KV is checksummed and its
                 header handed to the sender (kv_layerwise); the decode worker reads
                 it out of this worker's cache while later layers compute
              -> first token; right after the step, before the next one starts: the
                 final message (the first token, and any layer not yet sent)
              -> response 1 (the first token: the client's time to first token
                 includes no KV transfer)
              -> the decode side's ack -> response 2 (KV bytes, seconds); the call
                 ends and the request's blocks, held until then, are freed

The engine thread only checksums and hands headers on; the transfer itself runs
in the decode worker and on the sender's thread, so the engine computes the next
layers, and the next batch, while the KV moves. A transfer that fails ends the call ABORTED after
response 1: the router then moves the request to another decode worker (it owns
it until the last token).

Who may name a destination: only callers with the cluster's certificate reach
this service (mutual TLS, see tandem/worker/server.py), and the KV sender
ships a request's KV only to a receiver that proves the cluster's KV secret,
so a destination outside the cluster gets nothing (the call fails ABORTED).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import grpc

from tandem import logs
from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.errors import InvalidRequestError
from tandem.kv_transfer import Destination, TransferError, TransferStatus
from tandem.kv_transfer.base import KV_FAILURE_KEY
from tandem.wire import finish_to_proto, logprob_to_proto
from tandem.worker.request import WorkRequest, parse_request

if TYPE_CHECKING:
    from tandem.prefill_worker.server import PrefillServer

log = logging.getLogger(__name__)


def parse_destination(
    p: worker_pb2.KvDestination, req: WorkRequest, engine: LLMEngine, kv_backend: str
) -> Destination:
    host, _, port = p.address.rpartition(":")
    if kv_backend == "inproc":
        valid = p.address.startswith("inproc://")
    else:
        valid = bool(host) and port.isdigit() and 0 < int(port) < 65536
    if not valid:
        raise InvalidRequestError(
            "destination.address",
            f"destination.address must be HOST:PORT with a port in [1, 65535] "
            f"({kv_backend} KV transfer), got {p.address[:100]!r}",
        )
    if p.request_id != req.request_id:
        raise InvalidRequestError(
            "destination.request_id",
            f"destination.request_id must equal request.request_id {req.request_id!r}, "
            f"got {p.request_id!r}",
        )
    # The KV shipped covers the prompt and any earlier output the request continues after,
    # less the first blocks the destination holds already.
    blocks = engine.kv.blocks_for(len(req.prompt_ids) + len(req.output_ids))
    if p.skip_blocks >= blocks:
        raise InvalidRequestError(
            "destination.skip_blocks",
            f"destination.skip_blocks must be less than the {blocks} blocks of the prompt "
            f"and output_token_ids, got {p.skip_blocks}",
        )
    need = blocks - p.skip_blocks
    if len(p.block_ids) < need:
        raise InvalidRequestError(
            "destination.block_ids",
            f"destination.block_ids must hold the {need} blocks of the prompt and "
            f"output_token_ids{f' after skip_blocks={p.skip_blocks}' if p.skip_blocks else ''}"
            f", got {len(p.block_ids)}",
        )
    return Destination(p.address, p.request_id, tuple(p.block_ids), p.skip_blocks)


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, server: PrefillServer) -> None:
        self.server = server
        self._active: set[str] = set()  # request ids in this worker (event loop thread)
        # Written by the engine thread (ship_rest) before the first token is delivered;
        # read by the handler after it.
        self._transfers: dict[str, Future[TransferStatus]] = {}
        self._destinations: dict[str, Destination] = {}  # engine thread only

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context
    ) -> AsyncIterator[worker_pb2.PrefillResponse]:
        loop, engine = self.server.loop, self.server.engine
        logs.request_id.set(request.request.request_id)  # this handler's log lines carry it
        if self.server.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.server.worker_id} is draining"
            )
        limit = self.server.config.max_queue
        if len(self._active) >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill worker {self.server.worker_id} has {len(self._active)} requests, "
                f"its limit (max_queue={limit}); try another worker",
            )
        theirs, mine = request.destination.block_size, engine.kv.block_size
        if theirs and theirs != mine:  # the destination's blocks, counted in its size
            await self._refuse_destination(
                context, request, f"handshake (block_size: prefill {mine}, decode {theirs})"
            )
        await loop.ended(request.request.request_id)  # an earlier call's, cancelled
        try:
            req = parse_request(request.request, engine, prefill_only=True)
            dest = parse_destination(
                request.destination, req, engine, self.server.config.kv_backend
            )
            if req.request_id in self._active:
                raise InvalidRequestError(
                    "request_id", f"request_id {req.request_id!r} is already running"
                )
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = req.request_id
        self._active.add(rid)
        outputs = loop.subscribe(rid)
        try:
            await loop.call(lambda e: self._add(e, req, dest))
            first = await outputs.get()
            if not first.token_ids:  # the engine failed the step that held this request
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"prefill of {rid} failed in the engine"
                )
            if first.held_block_ids is None:  # the first token ended the request
                self.server.served += 1
                yield self._first(first)
                return
            yield self._first(first)
            # ship_rest started it before the step's outputs were delivered.
            fut = self._transfers[rid]
            try:
                status = await asyncio.wait_for(
                    asyncio.wrap_future(fut), self.server.config.kv_ack_timeout_s
                )
            except ValueError as exc:  # the destination cannot take these blocks
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"destination: {exc}")
            # ABORTED, not UNAVAILABLE: this worker is fine, the decode side failed.
            except TimeoutError:
                # A failed transfer (wait_for's cancel of its future reads, to the
                # sender, as this call's give-up, which is not counted).
                self.server.transfer_metrics.record_failure("timeout")
                context.set_trailing_metadata(((KV_FAILURE_KEY, "timeout"),))
                log.warning("KV transfer %s failed: no ack within %g s", rid,
                            self.server.config.kv_ack_timeout_s,
                            extra={"request_id": rid})  # fmt: skip
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"KV transfer of {rid} to {dest.address}: no ack within "
                    f"{self.server.config.kv_ack_timeout_s:g} s",
                )
            except TransferError as exc:
                # "closed": this worker's own sender shut down (it is stopping).
                gone = exc.reason == "closed"
                context.set_trailing_metadata(((KV_FAILURE_KEY, exc.reason),))
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE if gone else grpc.StatusCode.ABORTED,
                    f"KV transfer of {rid} to {dest.address} failed: {exc.reason} ({exc})",
                )
            self.server.served += 1
            yield worker_pb2.PrefillResponse(
                kv_bytes=status.bytes, kv_transfer_seconds=status.seconds
            )
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            # Queued behind a send still in flight on the engine thread, so it sees it; and
            # awaited, so the caller hears how the call ended only once its blocks are free.
            ended = loop.end(rid, lambda e: self._end(e, rid))
            self._active.discard(rid)
            try:
                await asyncio.shield(ended)
            except Exception:  # the call's own outcome stands
                log.exception("freeing the blocks of %s failed", rid)

    async def _refuse_destination(self, context, request: worker_pb2.PrefillRequest, why: str):
        """Ends the call as a KV handshake that failed ends it (ABORTED, the reason in the
        trailing metadata, counted): a decode worker configured otherwise, which the
        router takes out of this worker's placement for a while, not a bad request.
        Before this, a decode worker of larger blocks was refused INVALID_ARGUMENT
        ("destination.block_ids must hold ..."), which blamed the client."""
        self.server.transfer_metrics.record_failure("handshake")
        context.set_trailing_metadata(((KV_FAILURE_KEY, "handshake"),))
        await context.abort(
            grpc.StatusCode.ABORTED,
            f"KV transfer of {request.request.request_id} to {request.destination.address} "
            f"failed: {why}",
        )

    async def Status(self, request, context) -> worker_pb2.WorkerStatus:
        if self.server.draining:  # out of placement until it has gone (router: down)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        return self.server.status()

    # ---- engine thread --------------------------------------------------------------

    def _add(self, engine: LLMEngine, req: WorkRequest, dest: Destination) -> None:
        # An earlier call with this id that was aborted has ended (``ended``): its id
        # may be sent again.
        self.server.sender.forget(req.request_id)
        engine.add_request(
            req.prompt_ids, req.params, req.request_id, prefill_only=True,
            output_ids=req.output_ids, cache_salt=req.cache_salt,
        )  # fmt: skip
        self._destinations[req.request_id] = dest  # for ship_layer

    def ship_layer(self, layer: int, done: list[tuple[str, list[int]]]) -> None:
        """Inside a step (``LLMEngine.on_prefill_layer``): layer ``layer`` of these prompts
        is computed; its KV goes out now, while the layers after it compute."""
        for rid, blocks in done:
            dest = self._destinations.get(rid)
            if dest is None:
                continue
            try:
                self.server.sender.send_layers(dest, blocks[dest.skip_blocks :], (layer, layer + 1))
            except ValueError as exc:  # the final send reports it to the caller
                log.warning("layer-wise KV of %s: %s", rid, exc)
                del self._destinations[rid]

    def ship_rest(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After a step (an EngineLoop step hook), before its outputs are delivered and
        before the next step: each prompt whose first token was just sampled ships what
        ship_layer did not (the first token, and every layer when KV goes whole), so
        the decode worker never waits for the next step. The decode worker reads the
        blocks in place, so they stay held until the call ends (``_end`` frees them).
        The transfer's future is in ``_transfers`` by the time the handler sees the
        first token."""
        for first in outputs:
            dest = self._destinations.get(first.request_id)
            if first.held_block_ids is None or dest is None:
                continue
            src = first.held_block_ids[dest.skip_blocks :]  # what the destination lacks
            try:
                fut = self.server.sender.send(dest, src, first.token_ids[0])
            except ValueError as exc:  # the destination cannot take these blocks
                fut = Future()
                fut.set_exception(exc)
            self._transfers[first.request_id] = fut

    def _end(self, engine: LLMEngine, rid: str) -> None:
        """Abort an unfinished transfer (nothing more is read from the blocks), then free them."""
        fut = self._transfers.pop(rid, None)
        shipping = self._destinations.pop(rid, None) is not None and self.server.config.kv_layerwise
        if (fut is not None and not fut.done()) or (fut is None and shipping):
            self.server.sender.abort(rid)  # also layers sent before the call ended
        engine.abort(rid)  # releases held KV, or stops a prefill still in the batch

    def end_all(self, engine: LLMEngine) -> None:
        for rid in {*self._transfers, *self._destinations}:
            self._end(engine, rid)
        engine.abort_all()

    @staticmethod
    def _first(first: RequestOutput) -> worker_pb2.PrefillResponse:
        response = worker_pb2.PrefillResponse(
            first_token_id=first.token_ids[0],
            text=first.text,
            finish_reason=finish_to_proto(first.finish_reason),
        )
        if first.logprobs:
            response.first_logprob.CopyFrom(logprob_to_proto(first.logprobs[0]))
        return response
