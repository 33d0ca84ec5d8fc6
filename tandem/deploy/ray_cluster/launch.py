"""What ``tandem ray up / status / scale / down`` do, as functions (the CLI is cli.py).

Each call connects to the Ray cluster as a short-lived driver, talks to the
deployment's controller (the detached actor ``controller`` in the configured
namespace) and disconnects; the deployment lives on in the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.config import RouterConfig
from tandem.deploy.ray_cluster.config import HEAD_NODE, RayDeployConfig
from tandem.deploy.ray_cluster.controller import Controller
from tandem.deploy.ray_cluster.head import (
    RayDeployError,
    auth_env,
    head_processes,
    read_state,
    start_head,
    stop_head,
    token_path,
    write_state,
)
from tandem.deploy.ray_cluster.state import CONTROLLER_NAME
from tandem.errors import TandemError
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import is_loopback

log = logging.getLogger(__name__)


def require_ray() -> None:
    """Fail with the install command when Ray is missing (without importing it)."""
    if importlib.util.find_spec("ray") is None:
        raise RayDeployError(
            "Ray is not installed; install Tandem with the ray extra: pip install 'tandem[ray]'"
        )


@contextlib.contextmanager
def connected(state: dict[str, Any]) -> Iterator[Any]:
    """A driver connection to ``state["address"]`` for the block's length (reused if
    this process has one).

    Authentication: what a local head recorded in ``state`` (its mode and token
    file); otherwise the environment decides, as for any Ray driver.
    """
    require_ray()
    address = state["address"]
    _use_auth(state)
    import ray

    if ray.is_initialized():
        yield ray
        return
    _probe(address)
    try:
        ray.init(address=address, namespace=state["namespace"], logging_level=logging.WARNING,
                 log_to_driver=False)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayDeployError(f"cannot connect to the Ray cluster at {address}: {exc}") from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once when nothing answers at a ``host:port`` address: ``ray.init`` would
    retry for many minutes (a rebooted machine, a head that crashed)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", ray://...: Ray's to resolve
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RayDeployError(
            f"cannot reach the Ray cluster at {address}: {exc} (is its head running?)"
        ) from exc


def _use_auth(state: dict[str, Any]) -> None:
    """Put the state's authentication into this process's environment, where Ray reads it."""
    env = auth_env(state, dict(os.environ))
    if env == dict(os.environ):
        return
    os.environ.clear()
    os.environ.update(env)
    import sys

    if "ray" in sys.modules:  # Ray caches the mode and the token once read
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def controller(ray, namespace: str):
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        raise RayDeployError(
            f"no Tandem deployment in namespace {namespace!r} on this Ray cluster "
            "(start one with `tandem ray up`)"
        ) from None


def up(
    config: RayDeployConfig,
    address: str | None,
    state_file: Path,
    local_cpus: int = 8,
    token_file: str | None = None,
) -> dict[str, Any]:
    """Deploy; returns the recorded state (``router`` is the address clients use).

    Without ``address`` a local head is started with ``local_cpus`` logical CPUs and
    the pools' custom resources, sized so every pool's maximum fits. With it,
    ``token_file`` is the cluster's Ray token (recorded for the later commands).
    """
    if read_state(state_file).get("router"):
        raise RayDeployError(
            f"{state_file} records a running deployment; `tandem ray down` first "
            "(or pass --state-file)"
        )
    require_ray()
    router = config.router
    exposed = not (is_loopback(router.host) or router.insecure or router.tls_cert_file)
    if address is None and exposed:
        # A head on this machine: its router serves this machine, unless TLS (or
        # --insecure) says it may serve every interface.
        log.info("a local head: the router serves on 127.0.0.1 (give it TLS to serve %s)",
                 router.host)  # fmt: skip
        config = dataclasses.replace(config, router=dataclasses.replace(router, host="127.0.0.1"))
    _check_exposure(config.router)  # before a head starts
    credentials = cluster_credentials(config)
    state: dict[str, Any] = {"namespace": config.namespace}
    if token_file is not None:
        if address is None:
            raise RayDeployError("--token-file is for --address (a local head makes its own)")
        if not Path(token_file).is_file():
            raise RayDeployError(f"--token-file {token_file}: no such file")
        state.update(auth_mode="token", auth_token_file=str(Path(token_file).resolve()))
    if address is None:
        state.update(start_head(local_cpus, _local_resources(config), token_path(state_file)))
        address = state["address"]
    state["address"] = address
    write_state(state_file, state)  # now, so that `down` can clean up a failed start
    ours = "head_pid" in state  # what `down` may stop if this start fails: our own head,
    try:  # or the deployment once this call has made its controller, never another's
        with connected(state) as ray:
            try:
                ray.get_actor(CONTROLLER_NAME, namespace=config.namespace)
            except ValueError:
                pass
            else:
                raise RayDeployError(
                    f"a Tandem deployment already runs in namespace {config.namespace!r}; "
                    "`tandem ray down` it or set ray.namespace"
                )
            ctrl = (
                ray.remote(Controller)
                .options(
                    name=CONTROLLER_NAME,
                    namespace=config.namespace,
                    lifetime="detached",
                    num_cpus=0,
                    max_concurrency=100,
                    # Its process dies: Ray starts it again, and it adopts the live
                    # actors (they are detached too; see controller.py).
                    max_restarts=-1,
                    # On the head: the controller lives as long as the cluster does.
                    resources=HEAD_NODE,
                )
                .remote(config, credentials)
            )
            ours = True  # made (a name another `up` took meanwhile fails the line above)
            # The controller bounds the router's start and each worker's (they start
            # together); the margin covers its own start and the router calls.
            timeout = config.router_timeout_s + config.startup_timeout_s + 60
            state["router"] = _get(ray, ctrl.start.remote(), timeout, "`up`")
    except BaseException:
        try:
            if ours:
                down(state_file)
            else:  # nothing of this call's runs: the namespace's deployment is not ours
                state_file.unlink(missing_ok=True)
        except Exception as exc:  # the start's error is the one to report
            log.warning("cleaning up after the failed start: %s", exc)
        raise
    write_state(state_file, state)
    return state


def _check_exposure(router: RouterConfig) -> None:
    """The router's own check at start (tandem/router/public_port.py), as far as it can
    be made here: its files are read on its node, not on this machine."""
    if is_loopback(router.host) or router.insecure or router.tls_cert_file:
        return
    raise RayDeployError(
        f"the router would serve on {router.host!r}, every interface of its node, without "
        "TLS: give router.tls_cert_file, router.tls_key_file and router.api_keys_file "
        "(files on the router's node; see deploy/README.md), or pass --insecure "
        "(router.insecure: true) if a proxy in front does TLS and authentication"
    )


def cluster_credentials(config: RayDeployConfig) -> ClusterCredentials | None:
    """The operator's files (read on this machine), a throw-away set, or None (insecure)."""
    own = ClusterCredentials.load(config.cluster)
    if own is None and not config.cluster.insecure:
        own = ClusterCredentials.create()
    return own


def _local_resources(config: RayDeployConfig) -> dict[str, float]:
    """Custom resources a one-node head needs to place every pool at its largest."""
    out: dict[str, float] = {}
    for pool in ("prefill", "decode"):
        res = config.pool(pool)
        most = max(res.replicas, config.autoscale.policy(pool).max_replicas) + 1
        for name, amount in res.resources.items():
            out[name] = out.get(name, 0) + amount * most
    for name, amount in config.router_actor.resources.items():
        if not name.startswith("node:"):  # Ray's own, per node (the router on the head)
            out[name] = out.get(name, 0) + amount
    return out


def status(state_file: Path, address: str | None = None) -> dict[str, Any]:
    state = _state(state_file, address)
    with connected(state) as ray:
        return ray.get(controller(ray, state["namespace"]).status.remote())


def scale(
    state_file: Path, prefill: int | None, decode: int | None, address: str | None = None
) -> dict[str, Any]:
    state = _state(state_file, address)
    with connected(state) as ray:
        # No timeout here: the controller bounds each worker's start and drain.
        return _get(ray, controller(ray, state["namespace"]).scale.remote(prefill, decode))


def _get(ray, ref, timeout: float | None = None, what: str = "") -> Any:
    """``ray.get``, with the controller's own errors (a bad size, workers that did not
    start) raised as RayDeployError carrying its message."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RayDeployError(f"{what} did not finish within {timeout:g} s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, TandemError):
            raise RayDeployError(str(cause)) from None
        raise


def down(state_file: Path, address: str | None = None, grace: float = 30.0) -> list[str]:
    """Stop the deployment (router drains first), then the local head if `up` started it.

    Returns what was stopped, for the CLI to print.
    """
    state = _state(state_file, address, required=False)
    # The file is forgotten only with what it records (--address of another cluster
    # leaves it, and the local head it may record, alone).
    recorded = state.get("address") == read_state(state_file).get("address")
    stopped: list[str] = []
    head_gone = bool(state.get("head_pid")) and not head_processes(state)
    if head_gone:  # a reboot or a crash took the local head, and its actors with it
        log.warning("the local Ray head (pid %s) is gone; forgetting its deployment",
                    state["head_pid"])  # fmt: skip
    elif state.get("address"):
        try:
            stopped += stop_deployment(state, grace)
        except Exception as exc:
            if not state.get("head_pid"):
                raise
            # The head goes anyway, and every actor with it.
            log.warning("stopping the deployment: %s: %s", type(exc).__name__, exc)
    if state.get("head_pid"):
        stop_head(state)  # and its temp dir and token, even when it is gone
        if not head_gone:
            stopped.append(f"local Ray head (pid {state['head_pid']})")
    if recorded and state_file.exists():
        state_file.unlink()
    return stopped


def stop_deployment(state: dict[str, Any], grace: float = 30.0) -> list[str]:
    """Shut the controller's actors down, kill the controller and any actor of the
    namespace left, wait until none is alive."""
    namespace = state["namespace"]
    with connected(state) as ray:
        try:
            ctrl = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        except ValueError:
            return []
        try:
            ray.get(ctrl.shutdown.remote(grace), timeout=grace + 120)
        except Exception as exc:  # killing the controller ends its actors too; checked below
            log.warning("the controller's shutdown: %s: %s", type(exc).__name__, exc)
        finally:
            ray.kill(ctrl, no_restart=True)
        # The actors are detached, so they outlive the controller: a shutdown that
        # did not finish leaves some, ended here.
        for name in tandem_actors(ray, namespace):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        deadline = time.monotonic() + 30
        while left := tandem_actors(ray, namespace):
            if time.monotonic() > deadline:
                raise RayDeployError(f"actors still alive after `down`: {', '.join(left)}")
            time.sleep(0.2)
        remove_placement_groups(ray, namespace)
        return [f"deployment in namespace {namespace!r} on {state['address']}"]


def remove_placement_groups(ray, namespace: str) -> list[str]:
    """Remove the deployment's placement groups that are left: detached, they would hold
    their resources on the cluster for good (a worker's start that a shutdown or a
    controller's death cut short frees none). Returns their names."""
    from ray.util.placement_group import PlacementGroup

    from tandem.deploy.ray_cluster.placement import is_group_of

    removed = []
    for pg_id, info in ray.util.placement_group_table().items():
        name = info.get("name", "")
        if is_group_of(name, namespace) and info.get("state") != "REMOVED":
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
            removed.append(name)
    if removed:
        log.info("removed placement groups left behind: %s", ", ".join(sorted(removed)))
    return removed


def tandem_actors(ray, namespace: str) -> list[str]:
    """Named actors alive in ``namespace`` (every actor a deployment makes is named)."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace
    )


def _state(state_file: Path, address: str | None, required: bool = True) -> dict[str, Any]:
    state = read_state(state_file)
    if address and address != state.get("address"):  # another cluster: not its token, head
        state = {"namespace": state.get("namespace", "tandem"), "address": address}
    if required and not state.get("address"):
        raise RayDeployError(
            f"no deployment recorded in {state_file}; pass --address or run `tandem ray up`"
        )
    state.setdefault("namespace", "tandem")
    return state
