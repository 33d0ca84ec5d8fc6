"""``Router``: the router's gRPC server, in-process (tests) or as a process (``__main__``).

It serves ``tandem.v1.Tandem``, ``grpc.health.v1`` and server reflection, over TLS
and behind API keys when configured (public_port.py: the port's rules; auth.py:
keys, checked for every call but health). Health:
the server ("") is SERVING while it accepts requests; ``tandem.v1.Tandem`` is
SERVING only while the pools it needs have a placeable worker (updated after
each Status poll); the HTTP ``/health`` is 200 exactly while the latter is
SERVING, else 503. ``stop()`` turns health to NOT_SERVING for good (and
``/health`` to 503, until the HTTP port has closed its connections), stops
accepting, lets in-flight streams finish for up to ``grace`` seconds, cancels
the rest (which cancels their worker calls), then closes the worker channels.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.config import RouterConfig, host_port
from tandem.errors import ConfigError
from tandem.keepalive import LAST_REPLIES_S, SERVER_OPTIONS, channel_options
from tandem.metrics import MetricsEndpoint, RouterMetrics
from tandem.router import public_port
from tandem.router.admission import Admission
from tandem.router.auth import CERTIFICATE_CALLERS, AuthInterceptor
from tandem.router.disaggregation import PrefillRouting
from tandem.router.frontend import Frontend
from tandem.router.gateway import Gateway
from tandem.router.placement import Pool, make_policy
from tandem.router.public_port import (
    PublicPort,
    connection_cap,
    grpc_connection_options,
    raise_descriptor_limit,
)
from tandem.router.registry import WorkerRegistry
from tandem.router.relay import Relay
from tandem.router.service import ParseInterceptor, TandemService
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import is_loopback

log = logging.getLogger(__name__)

SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name


class _BoundedHealth(health.aio.HealthServicer):
    """gRPC's health service, its Watch streams bounded across the server (``limit``):
    past it a Watch is refused RESOURCE_EXHAUSTED, naming the limit, while Check and
    the Watch streams already open go on. No key is needed for health, and without a
    bound every connection the port admits could hold 1,024 Watch streams."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit
        self._watches = 0

    async def Watch(self, request, context) -> None:
        if self._watches >= self._limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._limit} Health.Watch streams are open, the most this router "
                "serves at once: use Health.Check, or watch again later",
            )
        self._watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watches -= 1


class Router:
    def __init__(
        self,
        config: RouterConfig,
        frontend: Frontend | None = None,
        credentials: ClusterCredentials | None = None,
    ) -> None:
        """``credentials``: the cluster's, for mutual TLS to the workers (default: the
        files ``config.cluster`` names; none: plaintext to the workers)."""
        self.config = config
        self.frontend = frontend  # loaded in start() when not given
        self.registry = WorkerRegistry(
            config.status_interval_s,
            config.worker_timeout_s,
            channel_options=channel_options(
                config.worker_keepalive_s, config.worker_keepalive_timeout_s
            ),
            credentials=credentials or ClusterCredentials.load(config.cluster),
        )
        self.admission = Admission(
            config.max_queue, config.key_max_streams, config.key_requests_per_s
        )
        self.metrics = RouterMetrics(config.model)
        self.relay = Relay(
            self.registry,
            make_policy(config.placement, config.prefix_imbalance_max),
            max_migrations=config.max_migrations,
            queue_timeout_s=config.queue_timeout_s,
            prefill_timeout_s=config.prefill_timeout_s,
            kv_path_cooldown_s=config.kv_path_cooldown_s,
            routing=PrefillRouting(config.disaggregation),
            metrics=self.metrics,
            prefix_cache_across_keys=config.prefix_cache_across_keys,
        )
        self.metrics.watch(self.registry.workers, self.relay)
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._http = None  # the OpenAI-compatible API (http/server.py), when http_port is set
        self._auth: AuthInterceptor | None = None  # with API keys: refuses calls without one
        self._ready = False  # the Tandem service's health, for the HTTP /health
        self.port: int | None = None
        self._owns_frontend = False
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the router is not started")
        return host_port(self.config.host, self.port)

    @property
    def metrics_address(self) -> str | None:
        """Where Prometheus scrapes the router ("host:port"), or None when off."""
        return self._metrics_endpoint.address if self._metrics_endpoint else None

    @property
    def http_address(self) -> str | None:
        """The OpenAI-compatible HTTP API's "host:port", or None when off."""
        return self._http.address if self._http is not None else None

    async def start(self) -> None:
        public = PublicPort.load(self.config)  # first: a bad setting starts nothing
        if public.client_ca and not public.keys:
            self.admission.keyless = CERTIFICATE_CALLERS
        self._auth = AuthInterceptor(public.keys) if public.keys else None
        if self.frontend is None:
            self.frontend = await asyncio.to_thread(Frontend.load, self.config)
            self._owns_frontend = True
        else:
            self.frontend = self.frontend.with_limits(self.config)
        self.gateway = Gateway(self.frontend, self.admission, self.relay, self.metrics)
        for address in self.config.prefill_workers:
            self.registry.add_worker(Pool.PREFILL, address)
        for address in self.config.decode_workers:
            self.registry.add_worker(Pool.DECODE, address)
        await self.registry.poll_once()  # placement has numbers from the first request on

        descriptors = raise_descriptor_limit()  # the ports' connection caps come from it
        log.info("open descriptors: up to %d; gRPC holds at most %d connections, HTTP %d",
                 descriptors, connection_cap(0.25), connection_cap(0.5))  # fmt: skip
        server = grpc.aio.server(
            options=[
                *SERVER_OPTIONS,
                *grpc_connection_options(),
                ("grpc.max_receive_message_length", self.config.max_request_bytes),
            ],
            # The key first: a refused one is UNAUTHENTICATED whatever the message holds.
            interceptors=[
                *([self._auth] if self._auth else []),
                ParseInterceptor(),
            ],
        )
        service = TandemService(self.gateway, self.config.stream_stall_timeout_s)
        tandem_pb2_grpc.add_TandemServicer_to_server(service, server)
        self._health = _BoundedHealth(public_port.MAX_HEALTH_WATCHES)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        bind = f"{self.config.host}:{self.config.port}"
        try:
            if public.credentials is None:
                port = server.add_insecure_port(bind)
            else:
                port = server.add_secure_port(bind, public.credentials)
        except RuntimeError as exc:
            port, reason = 0, str(exc)
        else:
            reason = "bind failed"
        if not port:
            await self.registry.stop()
            raise ConfigError(f"router cannot listen on {bind} (settings host, port): {reason}")
        self.port = port
        if self.config.metrics_port is not None:
            if self.config.metrics_host is None and not is_loopback(self.config.host):
                log.warning(
                    "router metrics on %s only, not on host %s: they name every worker "
                    "and take no key; set metrics_host to an address inside the "
                    "cluster's network for a Prometheus elsewhere",
                    self.config.metrics_bind_host, self.config.host,
                )  # fmt: skip
            endpoint = MetricsEndpoint(self.metrics.registry)
            try:
                endpoint.start(self.config.metrics_bind_host, self.config.metrics_port)
            except ConfigError:
                await self.registry.stop()
                raise
            self._metrics_endpoint = endpoint
        if self.config.http_port is not None:
            from tandem.router.http.server import HttpApi

            self._http = HttpApi(
                self.gateway, public.keys, lambda: self._ready, self.config.max_request_bytes
            )
            try:
                await self._http.start(self.config)
            except ConfigError:
                self._http = None
                await self.registry.stop()
                raise
        await server.start()
        self._server = server
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._update_health()
        self.registry.start(after_poll=self._after_poll)
        log.info(
            "router serving on %s (%s, %s)",
            self.address,
            "plaintext" if public.credentials is None
            else "mutual TLS" if public.client_ca else "TLS",
            f"{len(public.keys)} API keys" if public.keys else "no API keys",
        )  # fmt: skip

    async def _after_poll(self) -> None:
        await self._update_health()
        self.relay.capacity.notify()  # a worker may have room now (freed by another router)

    async def _update_health(self) -> None:
        """The process is SERVING while it runs; the Tandem service only while every
        pool it needs has a placeable worker (a load balancer can then route elsewhere):
        the decode pool, and the prefill pool unless decode workers may prefill."""
        pools = [Pool.DECODE] + [Pool.PREFILL] * self.relay.routing.needs_prefill_pool
        ready = all(self.registry.placeable(pool) for pool in pools)
        # Not ready again once a drain has begun, whatever a poll round during it finds:
        # /health stays 503 as gRPC's health stays NOT_SERVING (it ignores set() then).
        self._ready = ready and self._server is not None and not self.gateway.stopping
        status = health_pb2.HealthCheckResponse
        if self._health is not None and self._server is not None:
            await self._health.set(SERVICE_NAME, status.SERVING if ready else status.NOT_SERVING)

    def add_worker(self, pool: Pool | str, address: str) -> None:
        self.registry.add_worker(pool, address)

    def remove_worker(self, pool: Pool | str, address: str) -> bool:
        return self.registry.remove_worker(pool, address)

    async def stop(self, grace: float | None = None) -> None:
        """Drains in-flight requests for up to ``grace`` seconds (None: the configured drain)."""
        if self._server is not None:
            # No new requests from here (gRPC: UNAVAILABLE "stopping"; HTTP: no new
            # connections, below), and not ready for good (_update_health); those in
            # flight, gRPC's and HTTP's at once, get the grace.
            self.gateway.stopping = True
            self._ready = False
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            grace = self.config.drain_timeout_s if grace is None else grace
            clock = asyncio.get_running_loop().time
            deadline = clock() + grace
            http = self._http.stop(grace) if self._http is not None else asyncio.sleep(0)
            http = asyncio.ensure_future(http)
            while self.admission.in_flight and clock() < deadline:
                await asyncio.sleep(0.05)
            # What is left gets a moment for its last replies, then is cut: a health
            # Watch never ends by itself, and gRPC's own graceful stop waited the whole
            # grace for it. (gRPC's stop is called once: twice at a time crashes it.)
            await self._server.stop(min(LAST_REPLIES_S, max(0.0, deadline - clock())))
            await http
            self._server = self._http = None
        await self.registry.stop()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()
            self._metrics_endpoint = None
        self.gateway.overloaded.flush()  # the refusals not logged yet
        if self._auth is not None:
            self._auth.refused.flush()
        self.relay.full.flush()
        if self.relay.routing.counts:
            log.info("prompts prefilled since start: %s", self.relay.routing.describe())
        if self._owns_frontend and self.frontend is not None:
            self.frontend.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
