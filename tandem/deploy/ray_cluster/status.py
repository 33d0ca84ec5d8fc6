"""What ``tandem ray status`` shows: the pools, the workers, the router, recent events."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tandem.deploy.autoscale import POOLS
from tandem.metrics import targets

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tandem.deploy.ray_cluster.controller import Controller


def status_report(ctrl: Controller, router_view: list[dict[str, Any]]) -> dict[str, Any]:
    workers = sorted(ctrl.workers.values(), key=lambda w: (w.pool, int(w.name.split("-")[-1])))
    return {
        "controller": _whoami(),
        "pools": _pools(ctrl),
        "router": ctrl.router_info.get("address", ""),
        "router_node": ctrl.router_info.get("node_ip", ""),
        "router_pid": ctrl.router_info.get("pid"),
        "router_metrics": ctrl.router_info.get("metrics_address", ""),
        "targets": dict(ctrl.targets),
        "autoscale": ctrl.config.autoscale.enabled,
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
        "metrics_targets_file": ctrl.config.targets_file if ctrl.config.metrics else "",
        "events": list(ctrl.events),
    }


def metrics_targets(ctrl: Controller) -> list[dict[str, Any]]:
    """Prometheus file_sd groups: the router and every serving worker with a metrics
    address, labelled by process name and role (as the local launcher's file)."""
    groups = []
    if ctrl.router_info.get("metrics_address"):
        groups.append(targets.group(ctrl.router_info["metrics_address"], "router", "router"))
    for w in sorted(ctrl.workers.values(), key=lambda w: w.name):
        address = w.info.get("metrics_address")
        if w.state == "serving" and address:
            groups.append(targets.group(address, w.name, w.pool))
    return groups


def write_targets(ctrl: Controller, stopped: bool = False) -> None:
    """Rewrite the targets file when membership changed (atomically: Prometheus may read
    it at any moment); ``stopped``: the deployment is gone, no targets."""
    groups = [] if stopped else metrics_targets(ctrl)
    if groups == ctrl.targets_written:
        return
    try:
        targets.write(ctrl.config.targets_file, groups)
    except OSError as exc:
        # Prometheus and `tandem top --file` go on reading what the file holds: stale
        # targets, or (a name in a shared /tmp taken first) another user's. Said once
        # in `tandem ray status` and logged on every try.
        path = ctrl.config.targets_file
        error = f"cannot write the metrics targets file {path}: {exc.strerror or exc}"
        log.warning("%s", error)
        if ctrl.targets_error != error:
            ctrl._event(f"{error}; set ray.metrics_targets_file to a file in a directory "
                        "only this deployment's user may write")  # fmt: skip
        ctrl.targets_error = error
        return
    ctrl.targets_written, ctrl.targets_error = groups, ""


def _pools(ctrl: Controller) -> dict[str, dict[str, Any]]:
    """Per pool: target, workers serving, and what a short pool waits for."""
    from tandem.deploy.ray_cluster.placement import cluster_missing

    out = {}
    for pool in POOLS:
        ws = [w for w in ctrl.workers.values() if w.pool == pool]
        serving = sum(w.state == "serving" and w.answering for w in ws)
        waiting = ""
        if serving < ctrl.targets[pool]:
            try:
                waiting = cluster_missing(ctrl.config.pool(pool).bundle())
            except Exception as exc:  # no Ray here (tests) or the GCS is busy
                waiting = f"unknown ({type(exc).__name__})"
            waiting = waiting or "starting or restarting"
        out[pool] = {"target": ctrl.targets[pool], "serving": serving, "waiting": waiting}
    return out


def _whoami() -> dict[str, Any]:
    import os

    import ray

    info: dict[str, Any] = {"pid": os.getpid()}
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        info.update(node_id=ctx.get_node_id(), actor_id=ctx.get_actor_id())
    return info
