"""Stand-ins for the controller's Ray actor handles: ``handle.method.remote(...)``
returns a coroutine, so the controller's awaits and timeouts run as with Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Method:
    """``.remote(*args)`` runs ``fn`` (plain or async); ``fail`` makes it raise, ``hang`` block."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls: list[tuple] = []
        self.fail: BaseException | None = None
        self.hang = False

    def remote(self, *args: Any):
        self.calls.append(args)
        return self._run(*args)

    async def _run(self, *args: Any) -> Any:
        if self.hang:
            await asyncio.Event().wait()
        if self.fail is not None:
            raise self.fail
        out = self.fn(*args)
        return await out if asyncio.iscoroutine(out) else out


class FakeRouter:
    def __init__(self) -> None:
        self.members: set[tuple[str, str]] = set()
        self.info = Method(lambda: {"address": "head:50051", "incarnation": "r1"})
        self.add_worker = Method(lambda pool, addr: self.members.add((pool, addr)))
        self.remove_worker = Method(lambda pool, addr: self.members.discard((pool, addr)))
        self.workers = Method(lambda: [])
        self.stop = Method(lambda grace: None)


class FakeWorker:
    """One worker actor; ``info``/``stats``/``drain`` answer like WorkerActor's."""

    def __init__(self, pool: str, name: str, incarnation: str = "i1", port: int = 4000) -> None:
        self.pool, self.name = pool, name
        self.current = self._info(incarnation, port, started_at=1.0)
        self.info = Method(lambda: dict(self.current))
        self.stats = Method(lambda: {**self.current, "running": 0, "queue_depth": 0})
        self.drain = Method(lambda grace: 7)

    def _info(self, incarnation: str, port: int, started_at: float) -> dict[str, Any]:
        return {
            "name": self.name, "pool": self.pool, "address": f"10.0.0.1:{port}",
            "incarnation": incarnation, "started_at": started_at, "node_ip": "10.0.0.1",
        }  # fmt: skip

    def restart(self, incarnation: str, port: int, started_at: float) -> dict[str, Any]:
        self.current = self._info(incarnation, port, started_at)
        return dict(self.current)


class FakeWorkerClass:
    """``.options(...).remote(pool, name, ...)`` makes a FakeWorker; ``setup`` adjusts it."""

    def __init__(self, setup: Callable[[FakeWorker], None] = lambda w: None) -> None:
        self.setup = setup
        self.made: dict[str, FakeWorker] = {}

    def options(self, **options: Any) -> FakeWorkerClass:
        return self

    def remote(self, pool: str, name: str, *rest: Any) -> FakeWorker:
        w = FakeWorker(pool, name, port=4000 + len(self.made))
        self.setup(w)
        self.made[name] = w
        return w
