"""The gRPC server shared by both worker roles: an engine on its own thread behind grpc.aio.

    start()   load the cluster credentials and the engine (off the event loop), open
              the KV transfer endpoint, bind the port (0: any free one) with mutual
              TLS, start the engine thread and the server, then report SERVING on
              grpc.health.v1 ("" and the role's service)
    stop()    NOT_SERVING first (routers stop placing here), no new Prefill or
              Decode calls and Status UNAVAILABLE (a router takes the worker out of
              placement and leaves it out: RenewLease still answers), in-flight ones get
              ``grace`` seconds and are then cancelled; whatever is left
              in the engine is aborted (blocks freed) before its thread stops (an
              engine that does not answer within 10 s is hung: the worker stops
              without it, its other ranks killed)

Liveness and load are separate signals: ``Status`` and health never wait for the
engine. The engine thread publishes its numbers (queues, batch, KV blocks) into a
snapshot before every step; ``Status`` answers from it on the event loop, so a
worker whose engine is busy with a long step still answers in milliseconds, with
numbers at most one step old.

Who may call: with cluster credentials (``config.cluster``, or given by the Ray
actor that hosts the server) the port speaks mutual TLS and the TLS handshake
refuses any caller without a certificate from the cluster CA, before any RPC
runs; the KV endpoint proves the cluster's KV secret to its peers. Without
them, a worker serves only on loopback unless ``cluster.insecure`` is set.

Metrics: with ``metrics_port`` set, Prometheus text on HTTP (tandem/metrics/),
read from the same snapshot as ``Status`` plus step and transfer histograms.

A worker with tensor_parallel_size > 1 is that many processes (tandem/engine/parallel.py):
this one is rank 0; when another rank dies, this process exits (``EXIT_RANK_LOST``)
and takes the rest with it, so that the router and Ray see one worker's death.

A hung engine is a dead worker too. Status and health answer without the engine, so
that a busy worker is never taken for a dead one; but an engine stuck in one step (a
GPU kernel or a collective that never returns, a deadlock) would then look alive
forever while its streams stall. The engine loop's watchdog (tandem/engine/loop.py)
finds a step or command running for over ``engine_stall_timeout_s`` (300 s; a step
takes seconds at most), and this process logs the engine thread's stack, kills its
other ranks and exits (``EXIT_ENGINE_STALLED``): the router sees the connection
fail and migrates the streams, and Ray starts a new worker. A step that fails in
the device's runtime (a CUDA error) ends the process the same way
(``EXIT_DEVICE_FAULT``) when the device then fails one small operation too (most
such errors are sticky: every later step would fail), rather than leave a worker
that fails each request it gets; an error that left the device working fails only
the step's requests.

Subclasses add their servicer and their KV transfer endpoint.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import threading
import traceback
from typing import NamedTuple

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tandem._proto.tandem.v1 import worker_pb2
from tandem.config import DecodeConfig, PrefillConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache import KVAllocator
from tandem.engine.loop import EngineLoop
from tandem.errors import ConfigError
from tandem.keepalive import LAST_REPLIES_S, SERVER_OPTIONS
from tandem.kv_transfer.base import TransferMetrics
from tandem.metrics import MetricsEndpoint, WorkerMetrics
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import is_loopback
from tandem.worker import EXIT_DEVICE_FAULT, EXIT_ENGINE_STALLED, EXIT_RANK_LOST
from tandem.worker.step_cost import StepCost

log = logging.getLogger(__name__)
_EXIT_LOG_S = 5.0  # how long an exiting worker gives its last log line
_ENGINE_ANSWER_S = 10.0  # how long a stopping worker waits for its engine, drained


class EngineLoad(NamedTuple):
    """The engine's numbers as of its last step (published by the engine thread)."""

    queue_depth: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    shipped_prefix_query_tokens: int = 0
    shipped_prefix_hit_tokens: int = 0
    host_blocks_used: int = 0
    host_swaps_out_total: int = 0
    host_swaps_in_total: int = 0
    host_prefix_hit_blocks_total: int = 0


class WorkerServer(abc.ABC):
    role: str  # "prefill" or "decode"
    service_name: str  # the full gRPC service name, for health checks
    role_proto: int  # worker_pb2.Role

    def __init__(
        self,
        config: PrefillConfig | DecodeConfig,
        engine: LLMEngine | None = None,
        credentials: ClusterCredentials | None = None,
    ):
        self.config = config
        self.engine: LLMEngine | None = engine  # tests may share one engine across servers
        # None until start() when config.cluster names files; stays None without any.
        self.credentials = credentials
        self.loop: EngineLoop | None = None
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        # Set by stop(): new Prefill/Decode calls are refused (UNAVAILABLE: the router
        # places them elsewhere) while the port still serves RenewLease and Status.
        self.draining = False
        self._stopping: asyncio.Future | None = None
        self._health = health_aio.HealthServicer()
        self.served = 0  # requests completed successfully (event loop thread writes)
        self.prefilled_here = 0  # decode: requests prefilled here (event loop thread writes)
        self.transfer_metrics = TransferMetrics()  # filled by the KV sender or receiver
        # Replaced whole by the engine thread (one reference assignment: atomic).
        self.engine_load = EngineLoad()
        # Written by the engine thread after each step. A prefill worker never runs a
        # step without prompt tokens: its whole steps are what its prompt tokens cost.
        self.step_cost = StepCost(decodes=self.role == "decode")
        self.metrics: WorkerMetrics | None = None  # from start(), once the worker id is known
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._owns_engine = False  # made in start(): closed in stop()

    @property
    def metrics_address(self) -> str | None:
        """Where Prometheus scrapes this worker ("host:port"), or None when off."""
        return self._metrics_endpoint.address if self._metrics_endpoint else None

    @property
    def address(self) -> str:
        """The bound gRPC address, "host:port"."""
        return f"{self.config.host}:{self.port}"

    @property
    def worker_id(self) -> str:
        return self.config.worker_id or f"{self.role}-{self.address}"

    def _kv_allocator(self) -> KVAllocator | None:
        """Where the engine's KV cache is made (None: torch.zeros)."""
        return None

    @property
    @abc.abstractmethod
    def kv_address(self) -> str:
        """Where KV is received ("" for a prefill worker)."""

    @property
    def kv_secret(self) -> bytes | None:
        return self.credentials.kv_secret if self.credentials is not None else None

    async def start(self) -> None:
        self._load_credentials()
        if self.engine is None:
            self.engine = await asyncio.to_thread(
                LLMEngine, self.config.engine, self._kv_allocator(), _rank_lost
            )
            self._owns_engine = True
        try:
            await self._serve()
        except BaseException:
            if self._owns_engine:  # its other tensor-parallel ranks, if any, end with it
                self.engine.close()
            raise

    async def _serve(self) -> None:
        stall_s = self.config.engine_stall_timeout_s
        self.loop = EngineLoop(
            self.engine,
            stall_timeout_s=stall_s or None,
            on_stall=self._engine_stalled,
            on_device_fault=self._device_fault,
        )
        await asyncio.to_thread(self._open_transfer)
        self.loop.add_hook(self._publish_load)
        self._publish_load(self.engine)
        loop, cost = self.loop, self.step_cost
        loop.add_step_hook(
            lambda engine, _: cost.observe(
                loop.last_step_seconds, engine.stats.last_sequences, engine.stats.last_tokens
            )
        )
        server = grpc.aio.server(options=SERVER_OPTIONS)
        self._add_servicer(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        where = f"{self.config.host}:{self.config.port}"
        try:
            if self.credentials is None:
                self.port = server.add_insecure_port(where)
            else:
                self.port = server.add_secure_port(where, self.credentials.server_credentials())
        except RuntimeError as exc:
            self._close_transfer()
            raise ConfigError(f"cannot listen on {where} (host/port): {exc}") from exc
        self._server = server
        self._start_metrics()
        self.loop.start()
        await server.start()
        for service in ("", self.service_name):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s worker %s serving (kv %s, %s)",
            self.role,
            self.address,
            self.kv_address or "-",
            "mutual TLS, KV authenticated" if self.credentials else "no TLS, KV unauthenticated",
        )

    def _start_metrics(self) -> None:
        """Metrics from the first step on (the worker id needs the bound port)."""
        metrics = self.metrics = WorkerMetrics(self)
        loop = self.loop
        loop.add_step_hook(
            lambda engine, _: metrics.on_step(
                loop.last_step_seconds, engine.stats.last_sequences, engine.stats.last_tokens
            )
        )
        self.transfer_metrics.on_done = metrics.transfer_seconds.observe
        if self.config.metrics_port is not None:
            endpoint = MetricsEndpoint(metrics.registry)
            try:
                endpoint.start(self.config.host, self.config.metrics_port)
            except ConfigError:
                self._close_transfer()
                raise
            self._metrics_endpoint = endpoint

    def _load_credentials(self) -> None:
        """The cluster credentials, and the rule that an open worker stays on loopback."""
        cluster = self.config.cluster
        if self.credentials is None:
            self.credentials = ClusterCredentials.load(cluster)
        if self.credentials is None and not cluster.insecure and not is_loopback(self.config.host):
            raise ConfigError(
                f"a {self.role} worker on {self.config.host} without cluster credentials would "
                "let anyone who reaches it call it and write into its KV: give cluster.ca_file, "
                "cluster.cert_file, cluster.key_file and cluster.kv_secret_file (tandem serve "
                "and tandem ray up create them), or set cluster.insecure: true"
            )

    async def stop(self, grace: float | None = None) -> None:
        """Drain for ``grace`` seconds (None: the config's drain_timeout_s), then stop.
        A second call while the first drains waits for it (a restarted Ray controller
        asks again)."""
        if self._stopping is None:
            if self._server is None:
                return
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        grace = self.config.drain_timeout_s if grace is None else grace
        await self._health.enter_graceful_shutdown()
        # The port stays open while the calls in flight finish: a reservation waiting for
        # its KV must still have its lease renewed (gRPC's own graceful stop refuses
        # every new call, RenewLease included, so such a stream's lease ran out).
        self.draining = True
        clock = asyncio.get_running_loop().time
        deadline = clock() + grace
        while self._calls_in_flight() and clock() < deadline:
            await asyncio.sleep(0.05)
        # What is left (a health Watch, which never ends by itself and would hold the
        # rest of the grace; a last reply on its way) gets a moment, then is cut.
        await self._server.stop(min(LAST_REPLIES_S, max(0.0, deadline - clock())))
        self._server = None
        # Cancelled handlers queued their clean-up first; this runs after it (FIFO).
        join_s = 10.0
        try:
            await asyncio.wait_for(self.loop.call(self._abort_all), _ENGINE_ANSWER_S)
        except TimeoutError:  # a hung engine: the process ends without it
            log.error("%s worker %s: the engine did not answer within %g s; stopping "
                      "without it", self.role, self.address, _ENGINE_ANSWER_S)  # fmt: skip
            if self.engine.tensor_parallel is not None:
                self.engine.tensor_parallel.kill()
            join_s = 0.1  # its thread will not end
        self.loop.stop(join_s)
        self._close_transfer()
        if self._owns_engine:
            self.engine.close()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()
        log.info("%s worker %s stopped", self.role, self.address)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _engine_stalled(self, seconds: float, stack: str) -> None:
        """The watchdog's thread: the engine is stuck in one step, and every request
        in it."""
        self._exit(
            EXIT_ENGINE_STALLED,
            f"the engine has been in one step for {seconds:.0f} s (engine_stall_timeout_s "
            f"{self.config.engine_stall_timeout_s:g}): it is hung, and its requests with it",
            f"The engine thread is at:\n{stack.rstrip()}",
        )

    def _device_fault(self, exc: BaseException) -> None:
        """The engine thread: a step failed in the device's runtime. After most such
        errors (an illegal address, ECC) the device is unusable and every later step
        fails; some (a launch's bad configuration) are one request's doing. So the
        device is tried once more: if it still works, the step's requests fail as after
        any failed step, and the worker serves on; a request cannot end workers one
        after the other as it moves."""
        if device_works(self.engine.device):
            log.error("a step failed on the device, which still works: %s", exc)
            return
        where = "".join(traceback.format_exception(exc)).rstrip()
        self._exit(EXIT_DEVICE_FAULT, f"a step failed on the device, which fails since: {exc}",
                   where)  # fmt: skip

    def _exit(self, code: int, why: str, detail: str) -> None:
        """End the process as a crashed worker's would end: the router moves its streams
        and its supervisor starts a new one. Its other ranks first: a stopped or stuck
        rank would not notice. The log is best effort: a thread stuck inside a log
        write (a stalled stderr pipe) holds its handler's lock, so the exit comes at
        the latest a few seconds later, logged or not."""
        if self.engine.tensor_parallel is not None:
            self.engine.tensor_parallel.kill()
        deadline = threading.Timer(_EXIT_LOG_S, os._exit, (code,))
        deadline.daemon = True
        deadline.start()
        log.critical(
            "%s worker %s: %s. The worker exits (code %d) so that the router moves its "
            "streams and its supervisor starts a new one. %s",
            self.role, self.address, why, code, detail,
        )  # fmt: skip
        logging.shutdown()
        os._exit(code)

    def status(self) -> worker_pb2.WorkerStatus:
        """What the Status RPC answers (and the Ray actor reports). Never waits for the
        engine: its numbers are the snapshot published before the current step."""
        m = self.transfer_metrics
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id,
            role=self.role_proto,
            **self.engine_load._asdict(),
            kv_address=self.kv_address,
            served=self.served,
            prefilled_here=self.prefilled_here,
            metrics_address=self.metrics_address or "",
            kv_transfers_total=m.transfers_done,
            kv_bytes_total=m.bytes_sent + m.bytes_received,
            kv_transfer_seconds_total=m.seconds_total,
            tensor_parallel_size=self.config.engine.tensor_parallel_size,
            kv_block_size=self.config.engine.block_size,
            kv_window_tokens=self.config.engine.kv_window_tokens or 0,
            prefix_cache_max_tokens=self._prefix_cache_max_tokens(),
            decode_step_seconds=self.step_cost.decode_step_seconds,
            prefill_token_seconds=self.step_cost.prefill_token_seconds,
        )

    def _prefix_cache_max_tokens(self) -> int:
        """Status's bound on what the prefix cache keeps of a prompt (0: none): a KV
        window's first slide on a decode worker; a prefill worker's prompts never slide."""
        if self.engine is None or self.role_proto != worker_pb2.ROLE_DECODE:
            return 0
        return self.engine.kv.first_slide_tokens() or 0

    def _publish_load(self, engine: LLMEngine) -> None:
        """Engine thread, before every step: one consistent snapshot of its numbers."""
        pool, host = engine.kv.pool, engine.kv.host
        self.engine_load = EngineLoad(
            queue_depth=len(engine.scheduler.waiting) + self._waiting_outside_engine(),
            running=len(engine.scheduler.running),
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_blocks_total=pool.num_blocks,
            prefix_query_tokens=engine.kv.prefix_query_tokens,
            prefix_hit_tokens=engine.kv.prefix_hit_tokens,
            shipped_prefix_query_tokens=engine.kv.shipped_query_tokens,
            shipped_prefix_hit_tokens=engine.kv.shipped_hit_tokens,
            host_blocks_used=host.num_used if host else 0,
            host_swaps_out_total=host.swaps_out if host else 0,
            host_swaps_in_total=host.swaps_in if host else 0,
            host_prefix_hit_blocks_total=host.prefix_hits if host else 0,
        )

    def _waiting_outside_engine(self) -> int:
        """Requests accepted but not yet in the engine's queue (engine thread)."""
        return 0

    def _calls_in_flight(self) -> int:
        """Prefill or Decode calls this worker is serving now (event loop)."""
        return len(self.service._active)

    @abc.abstractmethod
    def _add_servicer(self, server: grpc.aio.Server) -> None: ...

    @abc.abstractmethod
    def _open_transfer(self) -> None:
        """Create the KV sender or receiver (blocking; runs off the event loop)."""

    @abc.abstractmethod
    def _close_transfer(self) -> None: ...

    @abc.abstractmethod
    def _abort_all(self, engine: LLMEngine) -> None:
        """Engine thread: end every request and free its blocks."""


def device_works(device: torch.device) -> bool:
    """Whether ``device`` still computes: after a runtime error, a sticky one fails
    every call from then on."""
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (torch.ones(2, device=device) * 2).sum().item() == 4
    except Exception:  # noqa: BLE001 - any failure means no
        return False


def _rank_lost(reason: str) -> None:
    """A tensor-parallel rank of this worker exited: the worker cannot compute, so it
    ends as a crashed worker would (the router moves its requests elsewhere, Ray
    restarts the actor), and its other ranks end with it (parallel.py)."""
    log.critical("%s; this worker exits", reason)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)
