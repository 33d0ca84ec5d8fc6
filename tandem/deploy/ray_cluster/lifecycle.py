"""A worker's start and stop (its states are told in controller.py).

Start: placement group (when it needs one), actor, first answer (its server is up),
then the router; a worker that does not get that far is killed and its resources
freed. Stop: out of the router, drain, kill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tandem.deploy.ray_cluster import membership
from tandem.deploy.ray_cluster.state import CONTROLLER_NAME, _why, _Worker

if TYPE_CHECKING:
    from tandem.deploy.ray_cluster.controller import Controller

log = logging.getLogger(__name__)


async def start_worker(ctrl: Controller, pool: str) -> str | None:
    """Start one worker and add it to the router. Returns None once it serves, or
    why it did not start; it is then gone and its resources are free."""
    from tandem.deploy.ray_cluster.placement import reserve

    cfg = ctrl.config
    name = f"{pool}-{ctrl._next_id}"
    ctrl._next_id += 1
    ctrl._save()
    options, pg = reserve(cfg.pool(pool), name, cfg.namespace)
    w = _Worker(name, pool, handle=None, placement_group=pg)
    try:
        await asyncio.wait_for(_launch(ctrl, w, options), cfg.startup_timeout_s)
    except BaseException as exc:  # a cancelled start (shutdown) frees its group too
        free(ctrl, w)
        if not isinstance(exc, Exception):
            raise
        reason = _why(exc, cfg.startup_timeout_s, "ray.startup_timeout_s", cfg.pool(pool))
        return _not_started(ctrl, name, exc, reason)
    try:
        await membership.route(ctrl, w)
    except BaseException as exc:
        # An add that timed out may have arrived: the router must not keep the address
        # of a worker that is killed now (nothing else would take it out).
        w.state = "draining"
        if isinstance(exc, Exception):
            await membership.leave_router(ctrl, w)
        elif w.address:  # cancelled (a lowered target): the add may arrive all the same,
            ctrl._owed_removals.add((w.pool, w.address))  # taken out at the next round
        free(ctrl, w)
        if not isinstance(exc, Exception):
            raise
        return _not_started(ctrl, name, exc, f"the router did not take it: {_why(exc)}")
    w.state, w.last_seen = "serving", time.monotonic()
    ctrl._event(f"{name} serving on {w.address} (node {w.info['node_ip']})")
    return None


def _not_started(ctrl: Controller, name: str, exc: Exception, reason: str) -> str:
    log.error("%s did not start: %r", name, exc)
    ctrl._event(f"{name} did not start: {reason}")
    return f"{name} did not start: {reason}"


async def _launch(ctrl: Controller, w: _Worker, options: dict[str, Any]) -> None:
    """Placement group (if any), then the actor, then its first answer (server up)."""
    if w.placement_group is not None:
        await w.placement_group.ready()
    w.handle = (
        _worker_class(ctrl)
        .options(
            name=w.name,
            namespace=ctrl.config.namespace,
            lifetime="detached",  # not the controller's: see controller.py's docstring
            max_concurrency=4,
            **options,
        )
        .remote(w.pool, w.name, ctrl.config, CONTROLLER_NAME, ctrl.credentials)
    )
    ctrl.workers[w.name] = w
    w.info = await w.handle.info.remote()


def _worker_class(ctrl: Controller) -> Any:
    if "worker" not in ctrl._actor_classes:
        import ray

        from tandem.deploy.ray_cluster.actors import WorkerActor

        ctrl._actor_classes["worker"] = ray.remote(WorkerActor)
    return ctrl._actor_classes["worker"]


async def stop_worker(ctrl: Controller, w: _Worker, grace: float | None) -> None:
    """Out of the router, drain, kill. The kill and the freeing happen whatever fails.
    ``grace`` None: a lost worker, not drained (a call to an actor Ray cannot place
    waits, and would hold the monitor for the drain's whole timeout)."""
    w.state = "draining"
    try:
        left = ctrl.router is not None and w.address and await membership.leave_router(ctrl, w)
        if grace is None:
            return
        if left:  # a request placed just before the removal reaches it before it stops
            await asyncio.sleep(0.5)
        try:
            served = await asyncio.wait_for(w.handle.drain.remote(grace), grace + 30)
            ctrl._event(f"{w.name} drained ({served} requests served)")
        except Exception as exc:
            ctrl._event(f"{w.name} did not drain: {type(exc).__name__}")
    finally:
        free(ctrl, w)


def free(ctrl: Controller, w: _Worker) -> None:
    """Kill the actor (a pending one is never placed) and release its placement group."""
    import ray

    ctrl.workers.pop(w.name, None)
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
