"""Ray options for one actor from its ``ActorResources``: resources, strategy, restarts.

``actor_options`` is pure (tested without Ray); ``reserve`` creates the placement
group a multi-device worker needs and returns the options that place the actor in
it. Ray's autoscaler, when the cluster has one, adds nodes for actors that do not
fit; ``request_capacity`` also tells it the pools' whole target size ahead of time.
"""

from __future__ import annotations

from typing import Any

from tandem.deploy.ray_cluster.config import ActorResources


def actor_options(res: ActorResources) -> dict[str, Any]:
    """Options for ``ActorClass.options(...)`` when no placement group is used."""
    return {
        "num_cpus": res.num_cpus,
        "num_gpus": res.num_gpus,
        "resources": dict(res.resources),
        "scheduling_strategy": res.strategy,
        "max_restarts": res.max_restarts,
    }


def reserve(res: ActorResources, name: str) -> tuple[dict[str, Any], Any]:
    """``(options, placement_group or None)``; the caller waits for ``pg.ready()``."""
    options = actor_options(res)
    if not res.uses_placement_group:
        return options, None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # One bundle with all the worker's devices, on one node. The group outlives
    # restarts of the actor, so a restarted worker finds its devices free.
    pg = placement_group([res.bundle()], strategy="STRICT_PACK", name=f"tandem-{name}")
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0
    )
    return options, pg


def request_capacity(pools: list[tuple[ActorResources, int]]) -> None:
    """Ask Ray's autoscaler to keep room for ``count`` actors of each kind (no-op without one)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[res.bundle() for res, count in pools for _ in range(count)])
