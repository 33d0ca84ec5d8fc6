"""Ray options for one actor from its ``ActorResources``: resources, strategy, restarts.

``actor_options`` is pure (tested without Ray); ``reserve`` creates the placement
group a multi-device worker needs and returns the options that place the actor in
it. Ray's autoscaler, when the cluster has one, adds nodes for actors that do not
fit; ``request_capacity`` also tells it the pools' whole target size ahead of time.
``missing`` says why an actor of some shape is not placed (for ``tandem ray status``).

Every actor and placement group of a deployment is detached: owned by the cluster,
not by the controller that created it, so that they outlive the controller's
process (Ray restarts it; see recovery.py). ``tandem ray down`` ends them.
"""

from __future__ import annotations

import re
from typing import Any

from tandem.deploy.ray_cluster.config import ActorResources


def actor_options(res: ActorResources) -> dict[str, Any]:
    """Options for ``ActorClass.options(...)`` when no placement group is used."""
    return {
        "num_cpus": res.worker_cpus,
        "num_gpus": res.worker_gpus,
        "resources": dict(res.resources),
        "scheduling_strategy": res.strategy,
        "max_restarts": res.max_restarts,
    }


def group_name(namespace: str, worker: str) -> str:
    """A worker's placement group's name: the deployment's own, so that ``down`` finds
    every group it made (one whose start was cut short too)."""
    return f"tandem-{namespace}-{worker}"


def is_group_of(name: str, namespace: str) -> bool:
    """Whether ``name`` is a worker's group in ``namespace`` exactly (namespace "prod"
    must not take "prod-eu"'s groups: placement groups are the whole cluster's)."""
    return re.fullmatch(rf"tandem-{re.escape(namespace)}-(prefill|decode)-\d+", name) is not None


def reserve(res: ActorResources, name: str, namespace: str) -> tuple[dict[str, Any], Any]:
    """``(options, placement_group or None)``; the caller waits for ``pg.ready()``."""
    options = actor_options(res)
    if not res.uses_placement_group:
        return options, None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # One bundle with all the worker's devices, on one node. The group outlives
    # restarts of the actor, so a restarted worker finds its devices free.
    pg = placement_group(
        [res.bundle()],
        strategy="STRICT_PACK",
        name=group_name(namespace, name),
        lifetime="detached",
    )
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0
    )
    return options, pg


def request_capacity(pools: list[tuple[ActorResources, int]]) -> None:
    """Ask Ray's autoscaler to keep room for ``count`` actors of each kind (no-op without one)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[res.bundle() for res, count in pools for _ in range(count)])


def missing(
    bundle: dict[str, float], nodes: list[dict[str, float]], available: dict[str, float]
) -> str:
    """Why an actor asking for ``bundle`` may wait: no alive node (``nodes``: each one's
    total resources) offers it, or they are all taken (``available``: what is free in
    the cluster). "" when it should fit (it is starting or restarting)."""
    if not any(all(n.get(k, 0) >= v for k, v in bundle.items()) for n in nodes):
        lacking = [k for k, v in bundle.items() if not any(n.get(k, 0) >= v for n in nodes)]
        what = f"no alive node has {', '.join(lacking)}" if lacking else "not on one node"
        return f"no alive node offers {bundle} ({what})"
    taken = {k: available.get(k, 0) for k, v in bundle.items() if available.get(k, 0) < v}
    if taken:
        free = ", ".join(f"{k} {v:g} free" for k, v in taken.items())
        return f"the nodes offering {bundle} are full ({free})"
    return ""


def cluster_missing(bundle: dict[str, float]) -> str:
    """``missing`` for the cluster this process is connected to ("unknown" without one)."""
    import ray

    if not ray.is_initialized():  # ray.nodes() would start a local Ray
        return "unknown (not connected to Ray)"

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    return missing(bundle, nodes, ray.available_resources())
