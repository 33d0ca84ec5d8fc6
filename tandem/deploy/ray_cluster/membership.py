"""The router's membership: the controller keeps it equal to its serving workers.

Each worker's ``routed`` is the address the router last confirmed for it; while it
differs from ``address`` an update is owed, and the monitor sends it again each round
(``sync_router``). ``router_lock`` keeps one update per worker in flight.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from tandem.deploy.ray_cluster import recovery
from tandem.deploy.ray_cluster.state import CALL_TIMEOUT_S, _Worker

if TYPE_CHECKING:
    from tandem.deploy.ray_cluster.controller import Controller


def replace(ctrl: Controller, w: _Worker, info: dict[str, Any]) -> None:
    """The worker restarted: its old address is to leave the router, the new one to join
    (the caller sends the update: ``sync_router``)."""
    old = w.address
    now = time.monotonic()
    w.info, w.restarts, w.last_seen, w.replaced_at = info, w.restarts + 1, now, now
    w.answering = True
    ctrl._event(f"{w.name} restarted: {old} -> {info['address']}")


async def route(ctrl: Controller, w: _Worker) -> None:
    """Make the router hold ``w.address`` in place of the address it held for ``w``.

    Raises when the router does not take it; ``w.routed`` then still differs from
    ``w.address``, so the update is owed. Both router calls are idempotent, so a retry
    after a call that timed out but arrived does no harm.
    """
    async with w.router_lock:
        if w.state == "draining" or w.routed == w.address:
            return  # ``stop_worker`` removes it, or nothing is owed
        address = w.address
        if w.routed:
            await asyncio.wait_for(
                ctrl.router.remove_worker.remote(w.pool, w.routed), CALL_TIMEOUT_S
            )
            w.routed = ""
        await asyncio.wait_for(ctrl.router.add_worker.remote(w.pool, address), CALL_TIMEOUT_S)
        w.routed = address


async def sync_router(ctrl: Controller, w: _Worker) -> None:
    """``route`` for a serving worker: on failure the monitor tries again next round."""
    try:
        await route(ctrl, w)
    except Exception as exc:
        ctrl._event(f"{w.name}: router not updated, retrying: {type(exc).__name__}: {exc}")


async def leave_router(ctrl: Controller, w: _Worker) -> bool:
    """Take a draining worker's addresses out of the router; returns whether it took that."""
    try:
        # An update in flight ends first; none starts after (the state is draining).
        async with w.router_lock:
            # ``address`` too: an add that timed out may have arrived all the same.
            for address in dict.fromkeys(a for a in (w.routed, w.address) if a):
                await asyncio.wait_for(
                    ctrl.router.remove_worker.remote(w.pool, address), CALL_TIMEOUT_S
                )
            w.routed = ""
    except Exception as exc:
        # A dead router places nothing; a restarted one gets only serving workers. A live
        # one (a call that timed out) is asked again by the monitor (``settle_removals``).
        ctrl._event(f"{w.name} not removed from the router: {type(exc).__name__}")
        ctrl._owed_removals |= {(w.pool, a) for a in (w.routed, w.address) if a}
        return False
    return True


async def settle_removals(ctrl: Controller) -> None:
    """Removals that failed before (the worker was stopped anyway): asked again, so that
    the router does not keep a killed worker's address for good. An address a worker
    holds again (a port given to a later worker) is no longer owed; one given while
    the removal was on its way may have been added before it: that worker's add is
    owed again, and sent. All at once, so that a router that does not answer holds
    the monitor's round up by one ``CALL_TIMEOUT_S``, not one per address."""

    def holders(address: str) -> list[_Worker]:
        return [w for w in ctrl.workers.values() if address in (w.routed, w.address)]

    async def settle(pool: str, address: str) -> None:
        if not holders(address):
            try:
                await asyncio.wait_for(
                    ctrl.router.remove_worker.remote(pool, address), CALL_TIMEOUT_S
                )
            except Exception:
                return  # next round
            ctrl._event(f"{pool} worker {address} out of the router at last")
        ctrl._owed_removals.discard((pool, address))
        for w in holders(address):
            async with w.router_lock:
                w.routed = ""  # its add may have come before the removal
            if w.state == "serving":
                await sync_router(ctrl, w)

    await asyncio.gather(*(settle(*owed) for owed in sorted(ctrl._owed_removals)))


async def leave_dead_nodes(ctrl: Controller, silent: list[_Worker]) -> None:
    """Take the workers of nodes Ray declared dead out of the router now (the router
    would stop placing on them after its own ``worker_timeout_s``). Ray restarts
    them elsewhere; ``route`` adds the new address then."""
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
                    ctrl.router.remove_worker.remote(w.pool, w.routed), CALL_TIMEOUT_S
                )
            except Exception as exc:
                ctrl._event(f"{w.name}: not removed from the router: {type(exc).__name__}")
                continue
            w.routed = ""
        ctrl._event(f"{w.name}: node {w.info['node_id'][:12]} lost; out of the router")


async def check_router(ctrl: Controller) -> None:
    """A restarted router knows no workers: each one is owed an add again (the monitor's
    next step sends them)."""
    try:
        info = await asyncio.wait_for(ctrl.router.info.remote(), 5.0)
    except Exception:
        return
    if info["incarnation"] == ctrl.router_info.get("incarnation"):
        return
    for w in list(ctrl.workers.values()):
        async with w.router_lock:  # an add in flight may have reached the old router
            w.routed = ""
    ctrl.router_info = info
    ctrl._event(f"router restarted on {info['address']}; registering the workers again")
