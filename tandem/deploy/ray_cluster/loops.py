"""The controller's two background loops.

The monitor reads every serving worker's stats each ``monitor_interval_s``: it
notices restarts and lost workers, takes a dead node's workers out of the router,
re-registers the workers with a restarted router, sends the router updates still
owed, and tops up a pool short of its target. The autoscaler feeds the same stats
to the policy (``tandem/deploy/autoscale.py``) each ``autoscale.interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from tandem.deploy.autoscale import POOLS
from tandem.deploy.ray_cluster import membership, recovery
from tandem.deploy.ray_cluster.state import _log_crash
from tandem.deploy.ray_cluster.status import write_targets

if TYPE_CHECKING:
    from tandem.deploy.ray_cluster.controller import Controller

log = logging.getLogger(__name__)


async def monitor_forever(ctrl: Controller) -> None:
    while True:
        try:
            await monitor_once(ctrl)
        except Exception:
            log.exception("monitor round failed")
        await asyncio.sleep(ctrl.config.monitor_interval_s)


async def monitor_once(ctrl: Controller) -> None:
    serving = [w for w in ctrl.workers.values() if w.state == "serving"]
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
            # Restarting (or gone): the router stops placing on it by itself. One that
            # Ray will not restart is replaced now, not after startup_timeout_s.
            if now - w.last_seen > ctrl.config.startup_timeout_s or recovery.dead_for_good(
                w.handle
            ):
                lost.append(w)
            continue
        if stats["incarnation"] != w.info.get("incarnation"):
            membership.replace(ctrl, w, {k: stats[k] for k in w.info})  # the router: below
        w.stats, w.last_seen = stats, now
    await membership.leave_dead_nodes(ctrl, [w for w in serving if not w.answering])
    for w in lost:
        why = ("Ray will not restart it" if recovery.dead_for_good(w.handle)
               else f"no answer for {ctrl.config.startup_timeout_s:g} s")  # fmt: skip
        ctrl._event(f"{w.name} lost: {why}")
    # Out of the router and freed, not drained, all at once: each drain of an actor
    # Ray cannot place waited out its timeout (30 s), one after another.
    await asyncio.gather(*(ctrl._stop_worker(w, grace=None) for w in lost))
    await membership.check_router(ctrl)
    await membership.settle_removals(ctrl)
    # Only answering workers: a silent one's address may be a dead node's.
    owed = [
        w
        for w in ctrl.workers.values()
        if w.state == "serving" and w.answering and w.routed != w.address
    ]
    await asyncio.gather(*(membership.sync_router(ctrl, w) for w in owed))
    if ctrl.config.metrics:
        write_targets(ctrl)
    for pool in _short(ctrl):
        # Replacements, or a start that failed before. In the background: a start may
        # take ``startup_timeout_s``, and the stats and the router need watching
        # meanwhile. One at a time per pool, so an unplaceable worker is not retried in
        # a loop, and a start waiting for a node holds up no other pool's.
        if pool not in ctrl._top_up or ctrl._top_up[pool].done():
            ctrl._top_up[pool] = asyncio.create_task(ctrl._reconcile([pool]))
            ctrl._top_up[pool].add_done_callback(_log_crash)
    for pool in _over(ctrl):
        # A target lowered while workers were adopted and not answering yet: a resize
        # drains serving workers only, so those past the target once they answer are
        # drained now (as a resize: the autoscaler waits for it).
        if not ctrl.resizing(pool):
            ctrl._resize_soon(pool)


def _short(ctrl: Controller) -> list[str]:
    """The pools with fewer live (starting or serving) workers than their targets."""
    live = [w.pool for w in ctrl.workers.values() if w.state != "draining"]
    return [pool for pool in POOLS if live.count(pool) < ctrl.targets[pool]]


def _over(ctrl: Controller) -> list[str]:
    """The pools with more serving workers than their targets."""
    serving = [w.pool for w in ctrl.workers.values() if w.state == "serving"]
    return [pool for pool in POOLS if serving.count(pool) > ctrl.targets[pool]]


async def autoscale_forever(ctrl: Controller) -> None:
    cfg = ctrl.config.autoscale
    while cfg.enabled:
        await asyncio.sleep(cfg.interval_s)
        try:
            await autoscale_once(ctrl)
        except Exception:
            log.exception("autoscale round failed")


async def autoscale_once(ctrl: Controller) -> None:
    """One round: each pool not resizing now is sized by the load of its workers that
    answer (a silent one's last numbers are a dead or restarting process's), and a
    new size is applied in the background. A pool that a resize (this autoscaler's or
    a ``scale``) is starting or draining workers for is left alone until that is done:
    its numbers do not show the change yet (``Controller.resizing``); and one start
    may wait ``startup_timeout_s`` for a node while the other pool needs sizing."""
    pools = [pool for pool in ctrl.autoscaler.pools if not ctrl.resizing(pool)]
    serving = [w for w in ctrl.workers.values()
               if w.state == "serving" and w.answering and w.stats]  # fmt: skip
    loads = {
        "prefill": [w.stats["queue_depth"] for w in serving if w.pool == "prefill"],
        "decode": [
            w.stats["kv_blocks_used"] / max(1, w.stats["kv_blocks_total"])
            for w in serving
            if w.pool == "decode"
        ],
    }
    decisions = ctrl.autoscaler.decide(time.monotonic(), dict(ctrl.targets), loads, pools)
    changed = [pool for pool, d in decisions.items() if d.replicas != ctrl.targets[pool]]
    for pool in changed:
        d = decisions[pool]
        ctrl._event(f"autoscale {pool}: {d.current} -> {d.replicas} ({d.reason})")
        ctrl._lower_ends_top_up(pool, d.replicas)
        ctrl.targets[pool] = d.replicas
    if changed:
        ctrl._save()
        for pool in changed:
            ctrl._resize_soon(pool)
