"""A restarted controller adopts the live actors (fakes, no Ray cluster), and ``missing``
names what a short pool waits for."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tandem.deploy.ray_cluster import adoption, recovery
from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.deploy.ray_cluster.controller import Controller
from tandem.deploy.ray_cluster.placement import missing
from tests.deploy.fake_actors import FakeRouter, FakeWorker, FakeWorkerClass

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)


def test_missing_names_the_resource_no_alive_node_has():
    nodes = [{"CPU": 4.0, "decode": 2.0}, {"CPU": 1.0}]
    bundle = {"CPU": 1.0, "prefill": 1}
    assert missing(bundle, nodes, {"CPU": 5.0}) == (
        "no alive node offers {'CPU': 1.0, 'prefill': 1} (no alive node has prefill)"
    )


def test_missing_tells_resources_no_node_has_together_from_full_nodes():
    nodes = [{"CPU": 1.0}, {"CPU": 0.0, "decode": 1.0}]
    bundle = {"CPU": 1.0, "decode": 1}
    assert missing(bundle, nodes, {}) == (
        "no alive node offers {'CPU': 1.0, 'decode': 1} (not on one node)"
    )
    nodes = [{"CPU": 2.0, "decode": 1.0}]
    assert missing(bundle, nodes, {"CPU": 1.0}) == (
        "the nodes offering {'CPU': 1.0, 'decode': 1} are full (decode 0 free)"
    )
    assert missing(bundle, nodes, {"CPU": 1.0, "decode": 1.0}) == ""


@pytest.fixture
def cluster(monkeypatch):
    """Live actors by name, as ``ray.get_actor`` finds them, plus what gets killed."""
    import ray

    actors: dict = {"router": FakeRouter()}
    killed: list = []
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: actors[name])
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    monkeypatch.setattr(
        recovery, "worker_names", lambda ns: sorted(n for n in actors if n != "router")
    )
    monkeypatch.setattr(recovery, "placement_group", lambda namespace, name: None)
    monkeypatch.setattr(adoption, "CALL_TIMEOUT_S", 0.3)  # the silent worker's first ask
    monkeypatch.setattr(recovery, "load", lambda ns: {"targets": {"decode": 2}, "next_id": 5})
    return actors, killed


def test_a_restarted_controller_adopts_the_live_workers_as_they_are(cluster):
    actors, killed = cluster
    router = actors["router"]
    serving = actors["decode-1"] = FakeWorker("decode", "decode-1", port=4001)
    unrouted = actors["prefill-0"] = FakeWorker("prefill", "prefill-0", port=4000)
    draining = actors["decode-2"] = FakeWorker("decode", "decode-2", port=4002)
    draining.current["draining"] = True
    silent = actors["decode-3"] = FakeWorker("decode", "decode-3", port=4003)

    async def answers_the_second_time():  # restarting: recover's ask times out
        if len(silent.info.calls) == 1:
            await asyncio.sleep(10)
        return dict(silent.current)

    silent.info.fn = answers_the_second_time
    router.members = {("decode", "10.0.0.1:4001"), ("decode", "10.0.0.1:4002"),
                      ("decode", "10.0.0.1:3999")}  # fmt: skip
    router.workers.fn = lambda: [{"pool": p, "address": a} for p, a in router.members]
    ctrl = Controller(RayDeployConfig(request_nodes=False, drain_timeout_s=0))
    ctrl._actor_classes["worker"] = FakeWorkerClass()  # a top-up would be a bug: none made

    async def go():
        await ctrl.recover()
        assert ctrl._ready.is_set()
        assert ctrl.workers["decode-3"].state == "starting"
        assert ctrl.workers["decode-2"].state == "draining"
        for _ in range(100):
            if ctrl.workers.get("decode-3") and ctrl.workers["decode-3"].state == "serving":
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.7)  # the drain's pause after leaving the router
        return await ctrl.status()

    st = _run_forever_loops_off(ctrl, go)
    assert ctrl.targets == {"prefill": 1, "decode": 2} and ctrl._next_id == 5
    assert ctrl._actor_classes["worker"].made == {}
    states = {w["name"]: w["state"] for w in st["workers"]}
    assert states == {"prefill-0": "serving", "decode-1": "serving", "decode-3": "serving"}
    # Nothing restarted; the draining one was stopped; the stale entry left the router.
    assert serving.info.calls and not killed[1:] and killed == [draining]
    assert draining.drain.calls == [(0,)]
    assert router.members == {("decode", "10.0.0.1:4001"), ("prefill", "10.0.0.1:4000"),
                              ("decode", "10.0.0.1:4003")}  # fmt: skip
    assert ctrl.workers["prefill-0"].routed == unrouted.current["address"]
    assert any("controller restarted: adopted 4 workers (2 serving)" in e for e in ctrl.events)


def _run_forever_loops_off(ctrl: Controller, coro_fn):
    """Run ``coro_fn`` with the monitor and autoscaler loops stubbed out, except that
    the monitor's router sync runs (it adds the unrouted worker)."""

    async def monitor_forever():
        while True:
            await ctrl._monitor_once()
            await asyncio.sleep(0.05)

    ctrl._monitor_forever = monitor_forever
    ctrl._autoscale_forever = lambda: asyncio.sleep(0)
    return asyncio.run(coro_fn())


def test_the_first_call_after_a_restart_recovers_once(cluster):
    actors, _ = cluster
    for i, name in enumerate(["prefill-0", "decode-1", "decode-2"]):  # the targets
        actors[name] = FakeWorker(name.split("-")[0], name, port=4000 + i)
    ctrl = Controller(RayDeployConfig(request_nodes=False))
    ctrl._actor_classes["worker"] = FakeWorkerClass()
    ctrl._ready.clear()  # as after a restart, with the self-call not yet through

    async def go():
        st, _ = await asyncio.gather(ctrl.status(), ctrl.recover())
        await ctrl.recover()  # again: nothing more
        return st

    ctrl._start_loops = lambda: None
    st = asyncio.run(go())
    assert [w["name"] for w in st["workers"]] == ["decode-1", "decode-2", "prefill-0"]
    assert ctrl._actor_classes["worker"].made == {}
    assert sum("controller restarted" in e for e in ctrl.events) == 1
    assert actors["router"].info.calls == [()]
