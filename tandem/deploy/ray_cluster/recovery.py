"""What a restarted controller rebuilds its view from: the checkpoint and the live actors.

The controller is a detached actor with ``max_restarts``: when its process dies,
Ray starts it again and runs ``__init__`` anew, with nothing of the old memory.
The router and the workers live on (they are detached too, so they do not share
the controller's fate), and each is a named actor in the deployment's namespace;
the router knows which worker addresses it places on. What lives only in the
controller is checkpointed here, in Ray's GCS key-value store (as Ray Serve's
controller does): the pool targets and the next worker number.

Every function is a no-op, or returns nothing found, outside a Ray driver or
actor (the controller's unit tests run without Ray).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

WORKER_NAME = re.compile(r"^(prefill|decode)-(\d+)$")
_KV_NAMESPACE = "tandem"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv if internal_kv._internal_kv_initialized() else None


def _key(namespace: str) -> str:
    return f"controller/{namespace}"


def save(namespace: str, checkpoint: dict[str, Any]) -> None:
    if (kv := _kv()) is not None:
        kv._internal_kv_put(
            _key(namespace), json.dumps(checkpoint), overwrite=True, namespace=_KV_NAMESPACE
        )


def load(namespace: str) -> dict[str, Any]:
    if (kv := _kv()) is None:
        return {}
    raw = kv._internal_kv_get(_key(namespace), namespace=_KV_NAMESPACE)
    return json.loads(raw) if raw else {}


def forget(namespace: str) -> None:
    if (kv := _kv()) is not None:
        kv._internal_kv_del(_key(namespace), namespace=_KV_NAMESPACE)


def restarted() -> bool:
    """Whether this is an actor Ray restarted (False outside an actor)."""
    import ray

    if not ray.is_initialized():
        return False
    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() is not None and ctx.was_current_actor_reconstructed


def call_self(method: str, within_s: float = 300.0) -> None:
    """Call this actor's own ``method`` once ``__init__`` has returned, from a thread.

    A call sent while Ray still sees the actor as restarting fails at once
    (ActorUnavailableError), so it is sent again until it gets through or
    ``within_s`` passes. ``method`` must be safe to call twice.
    """
    import ray

    handle = ray.get_runtime_context().current_actor

    def run() -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                ray.get(getattr(handle, method).remote())
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    log.error("calling %s on this actor failed: %r", method, exc)
                    return
                time.sleep(0.5)

    threading.Thread(target=run, name=f"call-{method}", daemon=True).start()


def worker_names(namespace: str) -> list[str]:
    """The workers alive (or restarting) in ``namespace``, by name."""
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and WORKER_NAME.match(a["name"])
    )


def placement_group(namespace: str, name: str) -> Any:
    """The worker's placement group (``placement.reserve`` names it), or None."""
    import ray

    from tandem.deploy.ray_cluster.placement import group_name

    try:
        return ray.util.get_placement_group(group_name(namespace, name))
    except ValueError:
        return None


def dead_nodes() -> set[str]:
    """Ids of the nodes the cluster has lost (empty outside Ray)."""
    import ray

    if not ray.is_initialized():
        return set()
    return {n["NodeID"] for n in ray.nodes() if not n["Alive"]}


def dead_for_good(handle: Any) -> bool:
    """Whether Ray has given the actor up (its restarts used up, or none allowed): its
    state in the cluster's own table is DEAD, not RESTARTING. False when that cannot be
    told (outside Ray, a handle without an id, another Ray's table)."""
    import ray

    actor_id = getattr(handle, "_actor_id", None)
    if actor_id is None or not ray.is_initialized():
        return False
    try:
        from ray._private import state

        return state.actors(actor_id.hex()).get("State") == "DEAD"
    except Exception:  # a private table: a Ray without it only waits the longer way
        return False
