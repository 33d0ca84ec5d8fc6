"""The controller: one detached, named Ray actor that owns a deployment.

It creates the router actor and the worker actors, keeps the router's membership
equal to the serving workers, and answers ``tandem ray status / scale / down``.
Every actor it creates is named and detached, so none shares its fate: when the
controller's process dies, Ray restarts it (``max_restarts``) and ``recover``
rebuilds the view from the live actors, the router's membership and the
checkpoint (recovery.py), adopting every worker as it is: none restarts.

A worker's life:

    starting   actor created (placement group first when it needs one); waits for
               its server, up to ``startup_timeout_s`` (a node may be booting). A
               worker that does not serve by then, or that the router does not
               take, is killed, its resources freed, and ``start``/``scale`` raise
               ``NotStarted`` saying why
    serving    added to the router, which places requests on it from then on
      crash    Ray restarts the actor (``max_restarts``): a new server on new ports
               announces itself (``worker_started``); the old address is removed
               from the router and the new one added (retried each monitor round
               until the router takes them). The monitor, which reads every
               worker's stats each ``monitor_interval_s``, catches the same
               change if the announcement is lost, and gives up on a worker that
               has not answered for ``startup_timeout_s`` (a replacement starts)
    draining   scale-down: removed from the router first (no new requests), then
               its server stops taking calls and lets in-flight ones finish
               (``drain_timeout_s``), then the actor is killed

Pool sizes change by ``scale`` (by hand) or by the autoscaling policy
(``tandem/deploy/autoscale.py``), which reads the same stats every
``autoscale.interval_s``. Either way ``_reconcile`` does the work, one pool's at a time
per pool: a start waiting for a node holds up no other pool. A pool left short of its
target (a worker that did not start, or was lost) is topped up by the monitor: one
attempt at a time per pool, checked each ``monitor_interval_s``.

A node that dies takes its workers' processes with it: the monitor takes their
addresses out of the router at once, and Ray restarts each worker (as after a
crash) on another node that offers its pool's resources, or, when none has room,
once such a node joins; ``status`` says which resources a short pool waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tandem import logs
from tandem.deploy.autoscale import POOLS, Autoscaler
from tandem.deploy.ray_cluster import adoption, lifecycle, loops, membership, recovery
from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.deploy.ray_cluster.state import (
    CALL_TIMEOUT_S,
    ROUTER_NAME,
    NotStarted,
    _log_crash,
    _log_errors,
    _why,
    _Worker,
)
from tandem.deploy.ray_cluster.status import status_report, write_targets
from tandem.errors import ConfigError
from tandem.security.cluster import ClusterCredentials

log = logging.getLogger(__name__)


class Controller:
    def __init__(
        self, config: RayDeployConfig, credentials: ClusterCredentials | None = None
    ) -> None:
        logs.configure("controller", fmt=config.log_format)
        self.config = config
        # Handed to every router and worker actor (mutual TLS, KV secret); None: off.
        self.credentials = credentials
        self.targets = {pool: config.pool(pool).replicas for pool in POOLS}
        self.workers: dict[str, _Worker] = {}
        self.router: Any = None
        self.router_info: dict[str, Any] = {}
        self.autoscaler = Autoscaler(config.autoscale, config.pools)
        self.events: deque[str] = deque(maxlen=50)  # recent membership changes, for status
        self.targets_written: list | None = None  # the metrics targets file's last contents
        self.targets_error = ""  # why the last write of that file failed ("": it did not)
        self._next_id = 0  # worker names are <pool>-<n>, never reused
        # One per pool, made on the actor's event loop: a pool's starts and drains are
        # one at a time, and a start waiting for a node holds up no other pool.
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task] = []
        # By pool: the monitor's top-up (``_reconcile``) and the autoscaler's resize in
        # progress, in the background (a start may wait ``startup_timeout_s``).
        self._top_up: dict[str, asyncio.Task] = {}
        self._resizes: dict[str, asyncio.Task] = {}
        # (pool, address) of stopped workers the router did not confirm it removed.
        self._owed_removals: set[tuple[str, str]] = set()
        self._scaling: set[str] = set()  # pools a manual ``scale`` is resizing now
        self._actor_classes: dict[str, Any] = {}
        # Calls wait for this while a restarted controller rebuilds its view.
        self._ready = asyncio.Event()
        self._recovery: asyncio.Task | None = None
        if recovery.restarted():
            recovery.call_self("recover")
        else:
            self._ready.set()

    # ---- calls from the CLI ------------------------------------------------------------

    async def start(self) -> str:
        """Start the router, then the pools; returns the router's address.

        Raises ``NotStarted`` naming each piece that did not start, and why.
        """
        self._locks = {pool: asyncio.Lock() for pool in POOLS}
        self._save()
        await self._start_router()
        failed = await self._reconcile()
        if failed:
            raise NotStarted("; ".join(failed))
        if self.config.metrics:
            write_targets(self)
        self._start_loops()
        return self.router_info["address"]

    async def _start_router(self) -> None:
        import ray

        from tandem.deploy.ray_cluster.actors import RouterActor
        from tandem.deploy.ray_cluster.placement import actor_options

        cfg = self.config
        router_cls = ray.remote(RouterActor)
        self.router = router_cls.options(
            name=ROUTER_NAME,
            namespace=cfg.namespace,
            lifetime="detached",
            **actor_options(cfg.router_actor),
        ).remote(cfg.router_config(), self.credentials, cfg.log_format)
        try:
            self.router_info = await asyncio.wait_for(
                self.router.info.remote(), cfg.router_timeout_s
            )
        except Exception as exc:
            ray.kill(self.router, no_restart=True)
            self.router = None
            reason = _why(exc, cfg.router_timeout_s, "ray.router_timeout_s", cfg.router_actor)
            self._event(f"router did not start: {reason}")
            raise NotStarted(f"the router did not start: {reason}") from None
        self._event(f"router serving on {self.router_info['address']}")

    def _start_loops(self) -> None:
        self._tasks += [
            asyncio.create_task(self._monitor_forever()),
            asyncio.create_task(self._autoscale_forever()),
        ]

    async def recover(self) -> None:
        """Ray restarted this controller: adopt the live router and workers, then resume.

        A worker that answers is serving again as it was (``routed`` as the router
        says); one that does not yet (restarting, or its node is gone) is adopted as
        starting and given ``startup_timeout_s``; one that was draining is drained
        and stopped. Router entries of no live worker are removed. Cooldowns start anew.
        Runs once however often it is called (``__init__`` asks for it, and so does
        any call that comes first).
        """
        if self._recovery is None:
            self._recovery = asyncio.create_task(self._recover())
        await asyncio.shield(self._recovery)

    async def _until_ready(self) -> None:
        if not self._ready.is_set():
            await self.recover()

    async def _recover(self) -> None:
        self._locks = {pool: asyncio.Lock() for pool in POOLS}
        try:
            await adoption.adopt_all(self)
        except Exception:  # what was adopted stays; the monitor does the rest
            log.exception("recovering after the restart failed")
            self._event("recovery after the restart failed: see the controller's log")
        finally:
            self._start_loops()
            self._ready.set()

    async def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        """Set pool sizes (None: unchanged) and wait until the pools have them.

        Raises ``NotStarted`` naming the workers that did not start (the targets stay
        set: the monitor tries again while a pool is short of its target).
        """
        await self._until_ready()
        wanted = {"prefill": prefill, "decode": decode}
        for pool, n in wanted.items():
            if n is None:
                continue
            policy = self.config.autoscale.policy(pool)
            if pool not in self.config.pools:
                raise ConfigError(
                    "this deployment has no prefill pool (router.disaggregation.mode 'never'): "
                    "its decode workers prefill"
                )
            least = 0 if pool == "prefill" and self.config.router.disaggregation.mode != (
                "always") else 1  # fmt: skip
            if n < least:
                raise ConfigError(f"--{pool} must be >= {least}, got {n}")
            if self.config.autoscale.enabled and not (
                policy.min_replicas <= n <= policy.max_replicas
            ):
                raise ConfigError(
                    f"--{pool} {n} is outside the autoscaling bounds "
                    f"[{policy.min_replicas}, {policy.max_replicas}] (ray.autoscale.{pool})"
                )
        now = time.monotonic()
        for pool, n in wanted.items():
            if n is not None and n != self.targets[pool]:
                self._lower_ends_top_up(pool, n)
                self.targets[pool] = n
                self.autoscaler.resized(pool, now)
        self._save()
        named = [pool for pool, n in wanted.items() if n is not None]
        # Only the pools named: another one's start waiting for a node is not this call's.
        self._scaling.update(named)
        try:
            failed = await self._reconcile(named)
        finally:
            self._scaling.difference_update(named)
        self._resized(named)
        if failed:
            raise NotStarted("; ".join(failed))
        return await self.status()

    async def status(self) -> dict[str, Any]:
        await self._until_ready()
        try:
            router_view = await asyncio.wait_for(self.router.workers.remote(), 5.0)
        except Exception:  # restarting: the view is back at the next call
            router_view = []
        return status_report(self, router_view)

    async def shutdown(self, grace: float = 30.0) -> None:
        """Drain the router's in-flight streams, then stop every actor this controller made."""
        import ray

        await self._until_ready()
        tasks = [*self._tasks, *self._top_up.values(), *self._resizes.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._top_up, self._resizes = [], {}, {}
        if self.router is not None:
            try:
                await asyncio.wait_for(self.router.stop.remote(grace), grace + CALL_TIMEOUT_S)
            except Exception as exc:  # already gone: nothing to drain there
                log.warning("router stop: %r", exc)
            ray.kill(self.router, no_restart=True)
            self.router = None
        _log_errors(
            "shutdown",
            await asyncio.gather(
                *(self._stop_worker(w, grace=1.0) for w in list(self.workers.values())),
                return_exceptions=True,
            ),
        )
        if self.config.request_nodes:
            self._request_capacity(empty=True)
        if self.config.metrics:
            write_targets(self, stopped=True)
        recovery.forget(self.config.namespace)
        self._event("shut down")

    # ---- calls from worker actors ---------------------------------------------------------

    async def worker_started(self, info: dict[str, Any]) -> None:
        """A worker's server is up. After a restart, its new address replaces the old one."""
        await self._until_ready()
        w = self.workers.get(info["name"])
        if w is None or w.state != "serving" or info["incarnation"] == w.info.get("incarnation"):
            return  # a first start (``_start_worker`` registers it) or news already known
        membership.replace(self, w, info)
        await membership.sync_router(self, w)

    # ---- pools -----------------------------------------------------------------------------

    async def _reconcile(self, pools: Sequence[str] = POOLS) -> list[str]:
        """Start or drain workers until each of ``pools`` serves its target count.

        Returns what went wrong: each worker that did not start, and any other job's
        error (empty: the pools are at their targets).
        """
        if self.config.request_nodes:
            self._request_capacity()
        done = await asyncio.gather(*(self._reconcile_pool(pool) for pool in pools))
        results = [r for pool_results in done for r in pool_results]
        failed = [r for r in results if isinstance(r, str)]
        return failed + _log_errors("reconcile", results)

    async def _reconcile_pool(self, pool: str) -> list:
        async with self._locks[pool]:
            live = [w for w in self.workers.values() if w.pool == pool and w.state == "serving"]
            # Adopted after a restart and not answering yet: it serves soon, or it is
            # lost and freed (adoption.py); started again here, the pool overshoots.
            starting = [w for w in self.workers.values()
                        if w.pool == pool and w.state == "starting"]  # fmt: skip
            missing = self.targets[pool] - len(live) - len(starting)
            jobs = [self._start_worker(pool) for _ in range(missing)]
            for w in self._pick_for_removal(live, len(live) - self.targets[pool]):
                w.state = "draining"
                jobs.append(self._stop_worker(w, self.config.drain_timeout_s))
            # Every job runs to its end whatever another does; each failure is reported.
            return await asyncio.gather(*jobs, return_exceptions=True)

    def _lower_ends_top_up(self, pool: str, target: int) -> None:
        """A target lowered ends the pool's top-up: its start may wait
        ``startup_timeout_s`` for a node, holding the pool's lock, and the resize would
        wait it out (``scale --decode N`` for minutes). The start is cancelled, which
        frees what it made; the monitor tops the pool up again if it is still short."""
        task = self._top_up.get(pool)
        if target < self.targets[pool] and task is not None and not task.done():
            task.cancel()

    def resizing(self, pool: str) -> bool:
        """Whether a resize of ``pool`` (the autoscaler's, or a manual ``scale``) is under
        way: its numbers do not show it yet. A top-up is not one: a start retried for a
        node that never comes would hide the pool from the autoscaler, which could
        otherwise lower the target and end the retries."""
        task = self._resizes.get(pool)
        return pool in self._scaling or (task is not None and not task.done())

    def _resize_soon(self, pool: str) -> None:
        """Apply ``pool``'s new target in the background; its cooldown counts from the end."""

        async def resize() -> None:
            await self._reconcile([pool])
            self._resized([pool])

        self._resizes[pool] = asyncio.create_task(resize())
        self._resizes[pool].add_done_callback(_log_crash)

    @staticmethod
    def _pick_for_removal(live: list[_Worker], count: int) -> list[_Worker]:
        """The least busy workers, newest first among equals."""
        if count <= 0:
            return []

        def busy(w: _Worker) -> tuple:
            s = w.stats
            return (s.get("running", 0) + s.get("queue_depth", 0), -int(w.name.split("-")[-1]))

        return sorted(live, key=busy)[:count]

    # ---- workers (lifecycle.py) and background loops (loops.py) --------------------------

    async def _start_worker(self, pool: str) -> str | None:
        return await lifecycle.start_worker(self, pool)

    async def _stop_worker(self, w: _Worker, grace: float | None) -> None:
        await lifecycle.stop_worker(self, w, grace)

    async def _monitor_forever(self) -> None:
        await loops.monitor_forever(self)

    async def _monitor_once(self) -> None:
        await loops.monitor_once(self)

    async def _autoscale_forever(self) -> None:
        await loops.autoscale_forever(self)

    async def _autoscale_once(self) -> None:
        await loops.autoscale_once(self)

    # ---- helpers -------------------------------------------------------------------------------

    def _request_capacity(self, empty: bool = False) -> None:
        from tandem.deploy.ray_cluster.placement import request_capacity

        try:
            request_capacity(
                [] if empty else [(self.config.pool(p), self.targets[p]) for p in POOLS]
            )
        except Exception as exc:  # no autoscaler API on this cluster: placement still works
            log.info("resource request to the Ray autoscaler failed: %s", exc)

    def _resized(self, pools: list[str]) -> None:
        """Cooldowns count from when a resize is done (new workers serve, removed ones
        drained), so that the next decision sees its effect."""
        now = time.monotonic()
        for pool in pools:
            self.autoscaler.resized(pool, now)

    def _save(self) -> None:
        """Checkpoint what a restarted controller cannot read from the live actors."""
        recovery.save(self.config.namespace, {"targets": self.targets, "next_id": self._next_id})

    def _event(self, text: str) -> None:
        log.info("%s", text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")
