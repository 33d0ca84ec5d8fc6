"""The Ray actors that host Tandem's servers: one worker or the router per actor process.

Each actor runs the same server class the processes of ``tandem serve`` run
(``PrefillServer``, ``DecodeServer``, ``Router``), in the actor's own process, on
an asyncio event loop in a background thread; the engine keeps its own thread.
Nothing else is spawned but a tensor-parallel worker's other ranks, which are the
actor's children and end with it (tandem/engine/parallel.py), so when Ray kills or
restarts the actor's process the server goes with it, its ranks are restarted
together, and no process is left behind.

Cluster credentials (CA, member certificate and key, KV secret) arrive as an
argument, from the controller, so they reach the actor's process through Ray
alone. A worker binds its node's IP on ports the OS picks. When Ray restarts a crashed
worker it runs ``__init__`` again: a new server on new ports, with a new
``incarnation``; the worker then tells the controller, which swaps the old
address for the new one in the router (and its monitor would notice anyway).

These are plain classes; the controller wraps them with ``ray.remote`` so that
importing this module needs neither Ray nor torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from tandem import logs
from tandem.config import RouterConfig
from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.kv_transfer.ucx.runtime import on_gpu, ucx_env_defaults
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import is_loopback

log = logging.getLogger(__name__)


class _EventLoopThread:
    """An asyncio loop on a daemon thread; ``run`` waits for a coroutine's result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run a plain function on the loop's thread (grpc.aio objects live there)."""

        async def wrapper():
            return fn()

        return self.run(wrapper(), timeout)


def _node() -> dict[str, str]:
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "pid": os.getpid(),
        "restarted": ctx.was_current_actor_reconstructed,
        "resources": ctx.get_assigned_resources(),  # what Ray placed it with, e.g. {"decode": 1}
    }


def _setup_process(process: str, log_format: str) -> None:
    logs.configure(process, fmt=log_format)  # request ids on every line, as locally


class WorkerActor:
    """A prefill or decode worker's server, serving from the end of ``__init__``."""

    def __init__(
        self,
        pool: str,
        name: str,
        config: RayDeployConfig,
        controller: str | None = None,
        credentials: ClusterCredentials | None = None,
    ) -> None:
        _setup_process(pool, config.log_format)
        self.pool, self.name = pool, name
        self.node = _node()
        worker_config = config.worker_config(pool, host=self.node["node_ip"])
        # before UCX starts
        ucx_env_defaults(cuda=on_gpu(worker_config.engine.device), host=worker_config.host)
        if pool == "prefill":
            from tandem.prefill_worker.server import PrefillServer as Server
        else:
            from tandem.decode_worker.server import DecodeServer as Server
        self.server = Server(worker_config, credentials=credentials)
        self._loop = _EventLoopThread(f"{name}-server")
        self._loop.run(self.server.start())
        self.incarnation = uuid.uuid4().hex
        self.started_at = time.time()
        self.draining = False  # a controller restarted mid-drain finishes the job
        log.info("%s serving on %s (%s)", name, self.server.address, self.incarnation)
        if controller is not None:
            self._announce(controller, config.namespace)

    def _announce(self, controller: str, namespace: str) -> None:
        """Tell the controller this worker serves (it matters after a restart)."""
        import ray

        try:
            ray.get_actor(controller, namespace=namespace).worker_started.remote(self.info())
        except ValueError:  # no controller (a test hosting the actor alone)
            log.info("no controller %r in namespace %r to announce to", controller, namespace)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pool": self.pool,
            "address": self.server.address,
            "kv_address": self.server.kv_address,
            "metrics_address": self.server.metrics_address or "",
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "draining": self.draining,
            **self.node,
        }

    def stats(self) -> dict[str, Any]:
        """``info`` plus the worker's own Status numbers (one consistent engine snapshot)."""
        status = self.server.status()
        numbers = {
            name: getattr(status, name)
            for name in ("queue_depth", "running", "kv_blocks_used", "kv_blocks_free",
                         "kv_blocks_total", "served")
        }  # fmt: skip
        return {**self.info(), **numbers}

    def drain(self, grace: float) -> int:
        """No new requests; in-flight ones get ``grace`` seconds; returns the served count."""
        log.info("%s draining (up to %g s)", self.name, grace)
        self.draining = True
        self._loop.run(self.server.stop(grace))
        return self.server.served


class RouterActor:
    """The router's server. Membership changes arrive as actor calls from the controller."""

    def __init__(
        self,
        config: RouterConfig,
        credentials: ClusterCredentials | None = None,
        log_format: str = "",
    ):
        _setup_process("router", log_format)
        from tandem.router.server import Router

        self.node = _node()
        if config.metrics_host is None and not is_loopback(config.host):
            # Scraped by the cluster's Prometheus, on its network (a router on loopback,
            # a head `up` started here, keeps them there too).
            config = dataclasses.replace(config, metrics_host=self.node["node_ip"])
        self.router = Router(config, credentials=credentials)
        self._loop = _EventLoopThread("router-server")
        self._loop.run(self.router.start())
        self.address = f"{self._advertised(config.host)}:{self.router.port}"
        metrics = self.router.metrics_address
        self.metrics_address = (
            f"{self._advertised(config.metrics_bind_host)}:{metrics.rsplit(':', 1)[1]}"
            if metrics else ""
        )  # fmt: skip
        self.incarnation = uuid.uuid4().hex
        log.info("router serving on %s", self.address)

    def _advertised(self, host: str) -> str:
        return self.node["node_ip"] if host in ("", "0.0.0.0", "::", "[::]") else host

    def info(self) -> dict[str, Any]:
        return {"address": self.address, "metrics_address": self.metrics_address,
                "incarnation": self.incarnation, **self.node}  # fmt: skip

    def add_worker(self, pool: str, address: str) -> None:
        self._loop.call(lambda: self.router.add_worker(pool, address))

    def remove_worker(self, pool: str, address: str) -> bool:
        return self._loop.call(lambda: self.router.remove_worker(pool, address))

    def workers(self) -> list[dict[str, Any]]:
        """The router's view: per worker, health and what this router has in flight there."""

        def view():
            return [
                {"pool": w.pool.value, "address": w.address, "healthy": w.healthy,
                 "inflight": w.inflight}
                for w in self.router.registry.workers()
            ]  # fmt: skip

        return self._loop.call(view)

    def stop(self, grace: float) -> None:
        """Stop taking requests; in-flight streams get ``grace`` seconds to finish."""
        self._loop.run(self.router.stop(grace))
