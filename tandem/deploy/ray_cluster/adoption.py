"""A restarted controller adopts the live router and workers as they are.

What it reads them from (its checkpoint, the named actors, the router's membership)
is in recovery.py. A worker that answers is serving again as it was; one that does
not yet is adopted as starting; one that was draining is drained and stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from tandem.deploy.autoscale import POOLS
from tandem.deploy.ray_cluster import lifecycle, membership, recovery
from tandem.deploy.ray_cluster.state import (
    CALL_TIMEOUT_S,
    ROUTER_NAME,
    _log_crash,
    _why,
    _Worker,
)

if TYPE_CHECKING:
    from tandem.deploy.ray_cluster.controller import Controller

log = logging.getLogger(__name__)


async def adopt_all(ctrl: Controller) -> None:
    import ray

    cfg = ctrl.config
    saved = recovery.load(cfg.namespace)
    ctrl.targets.update(saved.get("targets", {}))
    try:
        ctrl.router = ray.get_actor(ROUTER_NAME, namespace=cfg.namespace)
    except ValueError:
        ctrl._event("no router after the restart: starting one")
        await ctrl._start_router()
    routed = []
    try:
        ctrl.router_info = await asyncio.wait_for(ctrl.router.info.remote(), cfg.router_timeout_s)
        routed = await asyncio.wait_for(ctrl.router.workers.remote(), CALL_TIMEOUT_S)
    except Exception as exc:  # restarting: the monitor registers every worker once back
        ctrl._event(f"the router did not answer after the restart: {type(exc).__name__}")
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
        group = recovery.placement_group(ctrl.config.namespace, name)
        w = _Worker(name, pool, handle, group, last_seen=now)
        ctrl.workers[name] = w
        if isinstance(info, BaseException):
            later.append(adopt(ctrl, w))  # stays "starting" until it answers
            continue
        w.info = info
        if info.get("draining"):
            w.state = "draining"
            later.append(ctrl._stop_worker(w, cfg.drain_timeout_s))
        else:
            w.state = "serving"
            w.routed = w.address if (pool, w.address) in in_router else ""
    known = {(w.pool, w.address) for w in ctrl.workers.values() if w.state == "serving"}
    for pool, address in in_router - known:
        await _sync_call(ctrl.router.remove_worker, pool, address)
    ctrl._next_id = max([saved.get("next_id", 0)] + [int(n.split("-")[-1]) + 1 for n in names])
    for pool in POOLS:
        ctrl.autoscaler.resized(pool, now)
    ctrl._event(
        f"controller restarted: adopted {len(names)} workers "
        f"({sum(w.state == 'serving' for w in ctrl.workers.values())} serving); "
        f"targets prefill={ctrl.targets['prefill']} decode={ctrl.targets['decode']}"
    )
    for job in later:
        task = asyncio.create_task(job)
        task.add_done_callback(_log_crash)
        ctrl._tasks.append(task)


async def adopt(ctrl: Controller, w: _Worker) -> None:
    """A worker found after a restart that did not answer: serving once it does."""
    cfg = ctrl.config
    try:
        w.info = await asyncio.wait_for(w.handle.info.remote(), cfg.startup_timeout_s)
        await membership.route(ctrl, w)
    except Exception as exc:
        reason = _why(exc, cfg.startup_timeout_s, "ray.startup_timeout_s", cfg.pool(w.pool))
        ctrl._event(f"{w.name} lost: {reason}")
        if w.address:  # an add that timed out may have arrived: not for a killed worker
            w.state = "draining"
            await membership.leave_router(ctrl, w)
        lifecycle.free(ctrl, w)
        return
    w.state, w.last_seen = "serving", time.monotonic()
    ctrl._event(f"{w.name} serving on {w.address} (node {w.info['node_ip']})")


async def _sync_call(method: Any, *args: Any) -> None:
    try:
        await asyncio.wait_for(method.remote(*args), CALL_TIMEOUT_S)
    except Exception as exc:
        log.warning("%r: %r", args, exc)
