"""Scripted prefill and decode workers (in-process grpc.aio servers) and a cluster harness.

The fakes speak the real worker protocol: Decode answers a KvDestination first,
then TokenChunks (the first token too, when asked to prefill here); Prefill
streams the first token, then the KV's outcome. Each call is recorded, and a
call that ends by cancellation is noted with its time, so tests can see what the
router sent and when it cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2, worker_pb2_grpc
from tandem.client import AsyncTandemClient
from tandem.config import RouterConfig
from tandem.router import Router
from tandem.router.frontend import Frontend

STOP = tandem_pb2.FINISH_REASON_STOP
LENGTH = tandem_pb2.FINISH_REASON_LENGTH


@dataclass
class Call:
    request: object
    time_remaining: float | None
    cancelled_at: float | None = None  # monotonic
    finished: bool = False


@dataclass
class FakeWorker:
    """Common part: a server, recorded calls, scripted Status numbers."""

    role: int
    queue_depth: int = 0
    running: int = 0
    kv_blocks_free: int = 1000
    kv_blocks_total: int = 1000
    prefix_query_tokens: int = 0
    kv_block_size: int = 16
    kv_window_tokens: int = 0
    status_fails: bool = False
    calls: list[Call] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    address: str = ""

    async def Status(self, request, context):
        if self.status_fails:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted Status failure")
        return worker_pb2.WorkerStatus(
            worker_id=self.address,
            role=self.role,
            queue_depth=self.queue_depth,
            running=self.running,
            kv_blocks_free=self.kv_blocks_free,
            kv_blocks_total=self.kv_blocks_total,
            kv_address="127.0.0.1:1",
            prefix_query_tokens=self.prefix_query_tokens,
            kv_block_size=self.kv_block_size,
            kv_window_tokens=self.kv_window_tokens,
        )

    def _record(self, request, context) -> Call:
        call = Call(request, context.time_remaining())
        self.calls.append(call)
        return call

    @contextlib.contextmanager
    def _watch(self, call: Call):
        try:
            yield
            call.finished = True
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: cancelled at a yield
            call.cancelled_at = time.monotonic()
            raise

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
            self.server = None


@dataclass
class FakeDecode(FakeWorker, worker_pb2_grpc.DecodeWorkerServicer):
    """``open_error``: abort the call with it before the destination. ``chunks``: what
    to stream after it, as (token_ids, finish_reason); then ``hang`` or ``fail_with``."""

    role: int = worker_pb2.ROLE_DECODE
    open_error: grpc.StatusCode | None = None
    chunks: list[tuple[list[int], int]] = field(
        default_factory=lambda: [([11], 0), ([12, 13], 0), ([14], LENGTH)]
    )
    hang: bool = False
    fail_with: grpc.StatusCode | None = None
    gate: asyncio.Event | None = None  # chunks wait for it when set
    # Chunks wait until one of these has delivered the request's KV (None: they don't).
    kv_from: list[FakePrefill] | None = None
    report_completion_tokens: bool = True
    text_padding: int = 0  # characters added to each chunk's text (a stream of bulk)

    lease_seconds: float = 30
    renewals: list[str] = field(default_factory=list)

    async def RenewLease(self, request, context):
        self.renewals.append(request.request_id)
        return worker_pb2.RenewLeaseResponse(renewed=True)

    async def Decode(self, request, context):
        call = self._record(request, context)
        with self._watch(call):
            if self.open_error is not None:
                await context.abort(self.open_error, "scripted open failure")
            rid = request.request.request_id
            here = request.prefill_here  # no KV to receive: the first token comes from here
            yield worker_pb2.DecodeResponse(
                destination=worker_pb2.KvDestination(
                    address="" if here else "127.0.0.1:1",
                    request_id=rid,
                    block_ids=[1, 2, 3],
                    lease_seconds=0 if here else self.lease_seconds,
                )
            )
            if self.gate is not None:
                await self.gate.wait()
            while self.kv_from is not None and not here:
                if any(rid in p.delivered for p in self.kv_from):
                    break
                await asyncio.sleep(0.01)
            if here:  # FakePrefill's first token
                token = FakePrefill.first_token + len(request.request.output_token_ids)
                yield worker_pb2.DecodeResponse(
                    chunk=worker_pb2.TokenChunk(token_ids=[token], text=f"<{token}>")
                )
            # A migrated request continues the script: skip what the client has and
            # the token its prefill returned.
            skip = len(request.request.output_token_ids) + 1
            done = 1  # the first token came from prefill
            for script_ids, finish in self.chunks:
                ids = script_ids[max(0, skip - done) :]
                done += len(script_ids)
                if not ids and not finish:
                    continue
                yield worker_pb2.DecodeResponse(
                    chunk=worker_pb2.TokenChunk(
                        token_ids=ids,
                        text="".join(f"<{i}>" for i in ids) + "." * self.text_padding,
                        finish_reason=finish,
                        completion_tokens=done if finish and self.report_completion_tokens else 0,
                    )
                )
            if self.fail_with is not None:
                await context.abort(self.fail_with, "scripted failure mid-stream")
            if self.hang:
                await asyncio.Event().wait()


@dataclass
class FakePrefill(FakeWorker, worker_pb2_grpc.PrefillWorkerServicer):
    """``error``/``hang``: before the first token. ``kv_error``/``kv_delay_s``: after it,
    while the KV would be on its way (then the call ends with the KV's outcome)."""

    role: int = worker_pb2.ROLE_PREFILL
    first_token: int = 10
    finish_reason: int = 0
    error: grpc.StatusCode | None = None
    hang: bool = False
    delay_s: float = 0.0  # queued behind other work this long
    kv_error: grpc.StatusCode | None = None
    kv_delay_s: float = 0.0
    kv_reason: str = ""  # the transfer's reason the call's trailing metadata gives
    delivered: set[str] = field(default_factory=set)  # request ids whose KV "arrived"

    async def Prefill(self, request, context):
        call = self._record(request, context)
        with self._watch(call):
            await asyncio.sleep(self.delay_s)
            if self.error is not None:
                await context.abort(self.error, "scripted prefill failure")
            if self.hang:
                await asyncio.Event().wait()
            # The script is first_token, first_token + 1, ...: a migrated request
            # (output_token_ids) gets the next one.
            token = self.first_token + len(request.request.output_token_ids)
            yield worker_pb2.PrefillResponse(
                first_token_id=token,
                text=f"<{token}>",
                finish_reason=self.finish_reason,
            )
            if self.finish_reason:
                return
            await asyncio.sleep(self.kv_delay_s)
            if self.kv_error is not None:
                if self.kv_reason:
                    context.set_trailing_metadata((("tandem-kv-failure", self.kv_reason),))
                await context.abort(self.kv_error, "scripted KV transfer failure")
            self.delivered.add(request.destination.request_id)
            yield worker_pb2.PrefillResponse(kv_bytes=1000, kv_transfer_seconds=self.kv_delay_s)


@dataclass
class SlowStatus(FakeDecode):
    """Takes ``status_delay_s`` to answer each Status (``asked``: how many came)."""

    status_delay_s: float = 1.0
    asked: int = 0

    async def Status(self, request, context):
        self.asked += 1
        await asyncio.sleep(self.status_delay_s)
        return await super().Status(request, context)


async def serve(worker: FakeWorker) -> FakeWorker:
    server = grpc.aio.server()
    if isinstance(worker, FakeDecode):
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    else:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker.server, worker.address = server, f"127.0.0.1:{port}"
    return worker


@dataclass
class Cluster:
    router: Router
    client: AsyncTandemClient
    prefill: list[FakePrefill]
    decode: list[FakeDecode]

    def worker_calls(self) -> int:
        """Prefill and Decode calls the workers received (Status polls not counted)."""
        return sum(len(w.calls) for w in [*self.prefill, *self.decode])


@contextlib.asynccontextmanager
async def cluster(
    frontend: Frontend,
    prefill: list[FakePrefill] | None = None,
    decode: list[FakeDecode] | None = None,
    connect: dict | None = None,
    **router_settings,
) -> AsyncIterator[Cluster]:
    """``connect``: the client's TLS and API key (AsyncTandemClient keyword arguments)."""
    prefill = [FakePrefill()] if prefill is None else prefill
    decode = [FakeDecode()] if decode is None else decode
    for w in [*prefill, *decode]:
        await serve(w)
    # A fake that fails Status answers UNAVAILABLE, which marks it down at once; the
    # timeout is only for a hung one, and must outlast a loaded machine's stalls.
    settings = {"status_interval_s": 0.05, "worker_timeout_s": 10.0, **router_settings}
    config = RouterConfig(
        model="tiny-random",
        port=0,
        prefill_workers=tuple(w.address for w in prefill),
        decode_workers=tuple(w.address for w in decode),
        drain_timeout_s=0.5,
        **settings,
    )
    router = Router(config, frontend=frontend)
    await router.start()
    client = AsyncTandemClient(router.address, timeout=10, **(connect or {}))
    try:
        yield Cluster(router, client, prefill, decode)
    finally:
        await client.close()
        await router.stop(grace=0)
        for w in [*prefill, *decode]:
            await w.stop()


async def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> float:
    """Polls ``predicate`` until true; returns the seconds it took (the timeout only
    guards against a hang: a loaded machine may be slow)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start
