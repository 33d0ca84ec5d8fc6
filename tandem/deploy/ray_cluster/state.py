"""What the controller's modules share: the actors' names, the controller's record of
each worker (``_Worker``; its states are told in controller.py), and how failures are
told (``NotStarted``, ``_why``, the logs)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import TandemError

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


def _why(exc: BaseException, timeout_s: float = 0, setting: str = "", res: Any = None) -> str:
    """What an operator reads when an actor did not start (``res``: its ActorResources;
    without it, a timeout is a call's, ``CALL_TIMEOUT_S``)."""
    # Python 3.10's asyncio.wait_for raises asyncio.TimeoutError, not yet the builtin.
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        if res is None:
            return f"no answer within {CALL_TIMEOUT_S:g} s"
        return (
            f"not serving within {timeout_s:g} s ({setting}): does the cluster have the "
            f"resources {res.bundle()} free? (`ray status` lists them)"
        )
    cause = _creation_error(exc)
    if cause is not None:  # the actor's constructor refused its settings: say only that
        return str(cause)
    return f"{type(exc).__name__}: {exc}"


def _creation_error(exc: BaseException) -> BaseException | None:
    """The TandemError an actor's constructor raised, inside Ray's ActorDiedError."""
    from tandem.errors import TandemError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TandemError):
            return exc
        # ActorDiedError holds the creation task's RayTaskError as its first argument,
        # and a RayTaskError the exception raised as its ``cause``.
        inner = [getattr(exc, "cause", None), *exc.args[:1], exc.__cause__]
        exc = next((e for e in inner if isinstance(e, BaseException)), None)
    return None


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
