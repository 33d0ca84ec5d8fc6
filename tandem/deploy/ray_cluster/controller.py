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
``autoscale.interval_s``. Either way ``_reconcile`` does the work, one at a time. A
pool left short of its target (a worker that did not start, or was lost) is topped up
by the monitor: one attempt at a time, checked each ``monitor_interval_s``.

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
from dataclasses import dataclass, field
from typing import Any

from tandem.deploy.autoscale import POOLS, Autoscaler
from tandem.deploy.ray_cluster import recovery
from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.errors import ConfigError, TandemError

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"
ROUTER_NAME = "router"
CALL_TIMEOUT_S = 10.0  # an actor call that only reads or updates a little state


class NotStarted(TandemError):
    """The router or some workers did not start; the message says which and why."""


@dataclass(eq=False)
class _Worker:
    name: str
    pool: str
    handle: Any  # ray.actor.ActorHandle
    placement_group: Any = None
    state: str = "starting"  # starting | serving | draining
    info: dict[str, Any] = field(default_factory=dict)  # WorkerActor.info()
    stats: dict[str, Any] = field(default_factory=dict)  # last WorkerActor.stats()
    restarts: int = 0
    last_seen: float = 0.0  # monotonic time of the last answer
    answering: bool = True  # whether the last stats call was answered
    replaced_at: float = 0.0  # monotonic time ``info`` last changed to a new incarnation
    # The address the router last confirmed for this worker ("": none). While it differs
    # from ``address``, the router owes an update, and the monitor retries it.
    routed: str = ""
    router_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # one at a time

    @property
    def address(self) -> str:
        return self.info.get("address", "")


class Controller:
    def __init__(self, config: RayDeployConfig) -> None:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        self.config = config
        self.targets = {pool: config.pool(pool).replicas for pool in POOLS}
        self.workers: dict[str, _Worker] = {}
        self.router: Any = None
        self.router_info: dict[str, Any] = {}
        self.autoscaler = Autoscaler(config.autoscale)
        self.events: deque[str] = deque(maxlen=50)  # recent membership changes, for status
        self._next_id = 0  # worker names are <pool>-<n>, never reused
        self._lock: asyncio.Lock | None = None  # made on the actor's event loop
        self._tasks: list[asyncio.Task] = []
        self._top_up: asyncio.Task | None = None  # the monitor's ``_reconcile`` in progress
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
        self._lock = asyncio.Lock()
        self._save()
        await self._start_router()
        failed = await self._reconcile()
        if failed:
            raise NotStarted("; ".join(failed))
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
        ).remote(cfg.router_config())
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
        self._lock = asyncio.Lock()
        try:
            await self._adopt_all()
        except Exception:  # what was adopted stays; the monitor does the rest
            log.exception("recovering after the restart failed")
            self._event("recovery after the restart failed: see the controller's log")
        finally:
            self._start_loops()
            self._ready.set()

    async def _adopt_all(self) -> None:
        import ray

        cfg = self.config
        saved = recovery.load(cfg.namespace)
        self.targets.update(saved.get("targets", {}))
        try:
            self.router = ray.get_actor(ROUTER_NAME, namespace=cfg.namespace)
        except ValueError:
            self._event("no router after the restart: starting one")
            await self._start_router()
        routed = []
        try:
            self.router_info = await asyncio.wait_for(
                self.router.info.remote(), cfg.router_timeout_s
            )
            routed = await asyncio.wait_for(self.router.workers.remote(), CALL_TIMEOUT_S)
        except Exception as exc:  # restarting: the monitor registers every worker once back
            self._event(f"the router did not answer after the restart: {type(exc).__name__}")
        found = {}
        for name in recovery.worker_names(cfg.namespace):
            try:
                found[name] = ray.get_actor(name, namespace=cfg.namespace)
            except ValueError:  # gone since listed
                continue
        names, handles = list(found), list(found.values())
        infos = await asyncio.gather(
            *(asyncio.wait_for(h.info.remote(), CALL_TIMEOUT_S) for h in handles),
            return_exceptions=True,
        )
        in_router = {(r["pool"], r["address"]) for r in routed}
        now, later = time.monotonic(), []
        for name, handle, info in zip(names, handles, infos, strict=True):
            pool = recovery.WORKER_NAME.match(name).group(1)
            w = _Worker(name, pool, handle, recovery.placement_group(name), last_seen=now)
            self.workers[name] = w
            if isinstance(info, BaseException):
                later.append(self._adopt(w))  # stays "starting" until it answers
                continue
            w.info = info
            if info.get("draining"):
                w.state = "draining"
                later.append(self._stop_worker(w, cfg.drain_timeout_s))
            else:
                w.state = "serving"
                w.routed = w.address if (pool, w.address) in in_router else ""
        known = {(w.pool, w.address) for w in self.workers.values() if w.state == "serving"}
        for pool, address in in_router - known:
            await self._sync_call(self.router.remove_worker, pool, address)
        self._next_id = max([saved.get("next_id", 0)] + [int(n.split("-")[-1]) + 1 for n in names])
        for pool in POOLS:
            self.autoscaler.resized(pool, now)
        self._event(
            f"controller restarted: adopted {len(names)} workers "
            f"({sum(w.state == 'serving' for w in self.workers.values())} serving); "
            f"targets prefill={self.targets['prefill']} decode={self.targets['decode']}"
        )
        for job in later:
            task = asyncio.create_task(job)
            task.add_done_callback(_log_crash)
            self._tasks.append(task)

    async def _adopt(self, w: _Worker) -> None:
        """A worker found after a restart that did not answer: serving once it does."""
        cfg = self.config
        try:
            w.info = await asyncio.wait_for(w.handle.info.remote(), cfg.startup_timeout_s)
            await self._route(w)
        except Exception as exc:
            reason = _why(exc, cfg.startup_timeout_s, "ray.startup_timeout_s", cfg.pool(w.pool))
            self._event(f"{w.name} lost: {reason}")
            self._free(w)
            return
        w.state, w.last_seen = "serving", time.monotonic()
        self._event(f"{w.name} serving on {w.address} (node {w.info['node_ip']})")

    async def _sync_call(self, method: Any, *args: Any) -> None:
        try:
            await asyncio.wait_for(method.remote(*args), CALL_TIMEOUT_S)
        except Exception as exc:
            log.warning("%r: %r", args, exc)

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
            if n < 1:
                raise ConfigError(f"--{pool} must be >= 1, got {n}")
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
                self.targets[pool] = n
                self.autoscaler.resized(pool, now)
        self._save()
        failed = await self._reconcile()
        self._resized([pool for pool, n in wanted.items() if n is not None])
        if failed:
            raise NotStarted("; ".join(failed))
        return await self.status()

    async def status(self) -> dict[str, Any]:
        await self._until_ready()
        try:
            router_view = await asyncio.wait_for(self.router.workers.remote(), 5.0)
        except Exception:  # restarting: the view is back at the next call
            router_view = []
        workers = sorted(self.workers.values(), key=lambda w: (w.pool, int(w.name.split("-")[-1])))
        return {
            "controller": self._whoami(),
            "pools": self._pools(),
            "router": self.router_info.get("address", ""),
            "router_node": self.router_info.get("node_ip", ""),
            "router_pid": self.router_info.get("pid"),
            "targets": dict(self.targets),
            "autoscale": self.config.autoscale.enabled,
            "workers": [
                {
                    **w.info,
                    **w.stats,
                    "name": w.name,
                    "pool": w.pool,
                    "state": "restarting" if w.state == "serving" and not w.answering else w.state,
                    "restarts": w.restarts,
                }
                for w in workers
            ],  # fmt: skip
            "router_workers": router_view,  # the router's own membership and health
            "events": list(self.events),
        }

    def _pools(self) -> dict[str, dict[str, Any]]:
        """Per pool: target, workers serving, and what a short pool waits for."""
        from tandem.deploy.ray_cluster.placement import cluster_missing

        out = {}
        for pool in POOLS:
            ws = [w for w in self.workers.values() if w.pool == pool]
            serving = sum(w.state == "serving" and w.answering for w in ws)
            waiting = ""
            if serving < self.targets[pool]:
                try:
                    waiting = cluster_missing(self.config.pool(pool).bundle())
                except Exception as exc:  # no Ray here (tests) or the GCS is busy
                    waiting = f"unknown ({type(exc).__name__})"
                waiting = waiting or "starting or restarting"
            out[pool] = {"target": self.targets[pool], "serving": serving, "waiting": waiting}
        return out

    @staticmethod
    def _whoami() -> dict[str, Any]:
        import os

        import ray

        info: dict[str, Any] = {"pid": os.getpid()}
        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            info.update(node_id=ctx.get_node_id(), actor_id=ctx.get_actor_id())
        return info

    async def shutdown(self, grace: float = 30.0) -> None:
        """Drain the router's in-flight streams, then stop every actor this controller made."""
        import ray

        await self._until_ready()
        tasks = self._tasks + ([self._top_up] if self._top_up is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._top_up = [], None
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
        recovery.forget(self.config.namespace)
        self._event("shut down")

    # ---- calls from worker actors ---------------------------------------------------------

    async def worker_started(self, info: dict[str, Any]) -> None:
        """A worker's server is up. After a restart, its new address replaces the old one."""
        await self._until_ready()
        w = self.workers.get(info["name"])
        if w is None or w.state != "serving" or info["incarnation"] == w.info.get("incarnation"):
            return  # a first start (``_start_worker`` registers it) or news already known
        self._replace(w, info)
        await self._sync_router(w)

    # ---- pools -----------------------------------------------------------------------------

    async def _reconcile(self) -> list[str]:
        """Start or drain workers until each pool's serving count equals its target.

        Returns what went wrong: each worker that did not start, and any other job's
        error (empty: the pools are at their targets).
        """
        async with self._lock:
            if self.config.request_nodes:
                self._request_capacity()
            jobs = []
            for pool in POOLS:
                live = [w for w in self.workers.values() if w.pool == pool and w.state == "serving"]
                missing = self.targets[pool] - len(live)
                jobs += [self._start_worker(pool) for _ in range(missing)]
                for w in self._pick_for_removal(live, -missing):
                    w.state = "draining"
                    jobs.append(self._stop_worker(w, self.config.drain_timeout_s))
            # Every job runs to its end whatever another does; each failure is reported.
            results = await asyncio.gather(*jobs, return_exceptions=True)
        failed = [r for r in results if isinstance(r, str)]
        return failed + _log_errors("reconcile", results)

    @staticmethod
    def _pick_for_removal(live: list[_Worker], count: int) -> list[_Worker]:
        """The least busy workers, newest first among equals."""
        if count <= 0:
            return []

        def busy(w: _Worker) -> tuple:
            s = w.stats
            return (s.get("running", 0) + s.get("queue_depth", 0), -int(w.name.split("-")[-1]))

        return sorted(live, key=busy)[:count]

    async def _start_worker(self, pool: str) -> str | None:
        """Start one worker and add it to the router. Returns None once it serves, or
        why it did not start; it is then gone and its resources are free."""
        from tandem.deploy.ray_cluster.placement import reserve

        cfg = self.config
        name = f"{pool}-{self._next_id}"
        self._next_id += 1
        self._save()
        options, pg = reserve(cfg.pool(pool), name)
        w = _Worker(name, pool, handle=None, placement_group=pg)
        try:
            await asyncio.wait_for(self._launch(w, options), cfg.startup_timeout_s)
            await self._route(w)
        except Exception as exc:
            reason = _why(exc, cfg.startup_timeout_s, "ray.startup_timeout_s", cfg.pool(pool))
            log.error("%s did not start: %r", name, exc)
            self._event(f"{name} did not start: {reason}")
            self._free(w)
            return f"{name} did not start: {reason}"
        w.state, w.last_seen = "serving", time.monotonic()
        self._event(f"{name} serving on {w.address} (node {w.info['node_ip']})")
        return None

    async def _launch(self, w: _Worker, options: dict[str, Any]) -> None:
        """Placement group (if any), then the actor, then its first answer (server up)."""
        if w.placement_group is not None:
            await w.placement_group.ready()
        w.handle = (
            self._worker_class()
            .options(
                name=w.name,
                namespace=self.config.namespace,
                lifetime="detached",  # not the controller's: see the module docstring
                max_concurrency=4,
                **options,
            )
            .remote(w.pool, w.name, self.config, CONTROLLER_NAME)
        )
        self.workers[w.name] = w
        w.info = await w.handle.info.remote()

    async def _stop_worker(self, w: _Worker, grace: float) -> None:
        """Out of the router, drain, kill. The kill and the freeing happen whatever fails."""
        w.state = "draining"
        try:
            if self.router is not None and w.address:
                try:
                    # An update in flight ends first; none starts after (the state is draining).
                    async with w.router_lock:
                        # ``address`` too: an add that timed out may have arrived all the same.
                        for address in dict.fromkeys(a for a in (w.routed, w.address) if a):
                            await asyncio.wait_for(
                                self.router.remove_worker.remote(w.pool, address), CALL_TIMEOUT_S
                            )
                        w.routed = ""
                except Exception as exc:
                    # A dead router places nothing; a restarted one gets only serving workers.
                    self._event(f"{w.name} not removed from the router: {type(exc).__name__}")
                else:
                    # A request placed just before the removal reaches the worker before it stops.
                    await asyncio.sleep(0.5)
            try:
                served = await asyncio.wait_for(w.handle.drain.remote(grace), grace + 30)
                self._event(f"{w.name} drained ({served} requests served)")
            except Exception as exc:
                self._event(f"{w.name} did not drain: {type(exc).__name__}")
        finally:
            self._free(w)

    def _free(self, w: _Worker) -> None:
        """Kill the actor (a pending one is never placed) and release its placement group."""
        import ray

        self.workers.pop(w.name, None)
        if w.handle is not None:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception as exc:
                log.warning("%s: kill: %r", w.name, exc)
        if w.placement_group is not None:
            try:
                ray.util.remove_placement_group(w.placement_group)
            except Exception as exc:
                log.warning("%s: placement group not removed: %r", w.name, exc)

    def _replace(self, w: _Worker, info: dict[str, Any]) -> None:
        """The worker restarted: its old address is to leave the router, the new one to join
        (the caller sends the update: ``_sync_router``)."""
        old = w.address
        now = time.monotonic()
        w.info, w.restarts, w.last_seen, w.replaced_at = info, w.restarts + 1, now, now
        w.answering = True
        self._event(f"{w.name} restarted: {old} -> {info['address']}")

    async def _route(self, w: _Worker) -> None:
        """Make the router hold ``w.address`` in place of the address it held for ``w``.

        Raises when the router does not take it; ``w.routed`` then still differs from
        ``w.address``, so the update is owed. Both router calls are idempotent, so a retry
        after a call that timed out but arrived does no harm.
        """
        async with w.router_lock:
            if w.state == "draining" or w.routed == w.address:
                return  # ``_stop_worker`` removes it, or nothing is owed
            address = w.address
            if w.routed:
                await asyncio.wait_for(
                    self.router.remove_worker.remote(w.pool, w.routed), CALL_TIMEOUT_S
                )
                w.routed = ""
            await asyncio.wait_for(self.router.add_worker.remote(w.pool, address), CALL_TIMEOUT_S)
            w.routed = address

    async def _sync_router(self, w: _Worker) -> None:
        """``_route`` for a serving worker: on failure the monitor tries again next round."""
        try:
            await self._route(w)
        except Exception as exc:
            self._event(f"{w.name}: router not updated, retrying: {type(exc).__name__}: {exc}")

    # ---- background loops --------------------------------------------------------------------

    async def _monitor_forever(self) -> None:
        while True:
            try:
                await self._monitor_once()
            except Exception:
                log.exception("monitor round failed")
            await asyncio.sleep(self.config.monitor_interval_s)

    async def _monitor_once(self) -> None:
        serving = [w for w in self.workers.values() if w.state == "serving"]
        asked = time.monotonic()
        results = await asyncio.gather(
            *(asyncio.wait_for(w.handle.stats.remote(), 5.0) for w in serving),
            return_exceptions=True,
        )
        now = time.monotonic()
        lost = []
        for w, stats in zip(serving, results, strict=True):
            if w.state != "serving" or w.replaced_at > asked:
                continue  # a drain began meanwhile, or news newer than these stats came
            w.answering = not isinstance(stats, BaseException)
            if not w.answering:
                # Restarting (or gone): the router stops placing on it by itself.
                if now - w.last_seen > self.config.startup_timeout_s:
                    lost.append(w)
                continue
            if stats["incarnation"] != w.info.get("incarnation"):
                self._replace(w, {k: stats[k] for k in w.info})  # the router: below
            w.stats, w.last_seen = stats, now
        await self._leave_dead_nodes([w for w in serving if not w.answering])
        for w in lost:
            self._event(f"{w.name} lost: no answer for {self.config.startup_timeout_s:g} s")
            await self._stop_worker(w, grace=0)
        await self._check_router()
        # Only answering workers: a silent one's address may be a dead node's.
        owed = [
            w
            for w in self.workers.values()
            if w.state == "serving" and w.answering and w.routed != w.address
        ]
        await asyncio.gather(*(self._sync_router(w) for w in owed))
        if self._short() and (self._top_up is None or self._top_up.done()):
            # Replacements, or a start that failed before. In the background: a start may
            # take ``startup_timeout_s``, and the stats and the router need watching
            # meanwhile. One at a time, so an unplaceable worker is not retried in a loop.
            self._top_up = asyncio.create_task(self._reconcile())
            self._top_up.add_done_callback(_log_crash)

    async def _leave_dead_nodes(self, silent: list[_Worker]) -> None:
        """Take the workers of nodes Ray declared dead out of the router now (the router
        would stop placing on them after its own ``worker_timeout_s``). Ray restarts
        them elsewhere; ``_route`` adds the new address then."""
        if not silent or not (dead := recovery.dead_nodes()):
            return
        for w in silent:
            if w.info.get("node_id") not in dead or not w.routed:
                continue
            async with w.router_lock:
                if w.state != "serving" or not w.routed:
                    continue
                try:
                    await asyncio.wait_for(
                        self.router.remove_worker.remote(w.pool, w.routed), CALL_TIMEOUT_S
                    )
                except Exception as exc:
                    self._event(f"{w.name}: not removed from the router: {type(exc).__name__}")
                    continue
                w.routed = ""
            self._event(f"{w.name}: node {w.info['node_id'][:12]} lost; out of the router")

    def _short(self) -> bool:
        """Whether a pool has fewer live (starting or serving) workers than its target."""
        live = [w.pool for w in self.workers.values() if w.state != "draining"]
        return any(live.count(pool) < self.targets[pool] for pool in POOLS)

    async def _check_router(self) -> None:
        """A restarted router knows no workers: each one is owed an add again (the monitor's
        next step sends them)."""
        try:
            info = await asyncio.wait_for(self.router.info.remote(), 5.0)
        except Exception:
            return
        if info["incarnation"] == self.router_info.get("incarnation"):
            return
        for w in list(self.workers.values()):
            async with w.router_lock:  # an add in flight may have reached the old router
                w.routed = ""
        self.router_info = info
        self._event(f"router restarted on {info['address']}; registering the workers again")

    async def _autoscale_forever(self) -> None:
        cfg = self.config.autoscale
        while cfg.enabled:
            await asyncio.sleep(cfg.interval_s)
            try:
                await self._autoscale_once()
            except Exception:
                log.exception("autoscale round failed")

    async def _autoscale_once(self) -> None:
        if self._lock is not None and self._lock.locked():
            return  # a resize is under way: the numbers do not show its effect yet
        serving = [w for w in self.workers.values() if w.state == "serving" and w.stats]
        loads = {
            "prefill": [w.stats["queue_depth"] for w in serving if w.pool == "prefill"],
            "decode": [
                w.stats["kv_blocks_used"] / max(1, w.stats["kv_blocks_total"])
                for w in serving
                if w.pool == "decode"
            ],
        }
        decisions = self.autoscaler.decide(time.monotonic(), dict(self.targets), loads)
        changed = False
        for pool, d in decisions.items():
            if d.replicas != self.targets[pool]:
                self._event(f"autoscale {pool}: {d.current} -> {d.replicas} ({d.reason})")
                self.targets[pool] = d.replicas
                changed = True
        if changed:
            self._save()
            await self._reconcile()
            self._resized([pool for pool, d in decisions.items() if d.replicas != d.current])

    # ---- helpers -------------------------------------------------------------------------------

    def _worker_class(self) -> Any:
        if "worker" not in self._actor_classes:
            import ray

            from tandem.deploy.ray_cluster.actors import WorkerActor

            self._actor_classes["worker"] = ray.remote(WorkerActor)
        return self._actor_classes["worker"]

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


def _why(exc: BaseException, timeout_s: float, setting: str, res: Any) -> str:
    """What an operator reads when an actor did not start (``res``: its ActorResources)."""
    # Python 3.10's asyncio.wait_for raises asyncio.TimeoutError, not yet the builtin.
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return (
            f"not serving within {timeout_s:g} s ({setting}): does the cluster have the "
            f"resources {res.bundle()} free? (`ray status` lists them)"
        )
    return f"{type(exc).__name__}: {exc}"


def _log_crash(task: asyncio.Task) -> None:
    """A background reconcile that raised (failed starts are events, not exceptions)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("reconciling the pools failed", exc_info=task.exception())


def _log_errors(what: str, results: list[Any]) -> list[str]:
    """Log the exceptions among ``gather(..., return_exceptions=True)`` results; returns them."""
    errors = []
    for r in results:
        if isinstance(r, BaseException):
            log.error("%s: %r", what, r, exc_info=r)
            errors.append(f"{type(r).__name__}: {r}")
    return errors
