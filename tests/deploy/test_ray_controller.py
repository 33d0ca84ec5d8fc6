"""The controller's handling of failures, with fake actor handles (no Ray cluster):
workers that do not start, a dead router, and a restart announced mid-monitor."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.deploy.ray_cluster.controller import Controller, NotStarted
from tests.deploy.fake_actors import FakeRouter, FakeWorkerClass

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)


@pytest.fixture
def killed(monkeypatch) -> list:
    """What the controller kills (actors) and frees (placement groups), in order."""
    import ray

    out: list = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: out.append(handle))
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda pg: out.append(pg))
    return out


def _controller(setup=lambda w: None, **settings) -> Controller:
    ctrl = Controller(RayDeployConfig(request_nodes=False, **settings))
    ctrl.router, ctrl.router_info = FakeRouter(), {"incarnation": "r1"}
    ctrl._actor_classes["worker"] = FakeWorkerClass(setup)
    return ctrl


def _run(ctrl: Controller, coro_fn):
    async def main():
        ctrl._locks = {pool: asyncio.Lock() for pool in ("prefill", "decode")}
        return await coro_fn()

    return asyncio.run(main())


def test_a_worker_the_router_does_not_take_is_killed_and_reported(killed):
    ctrl = _controller()
    ctrl.router.add_worker.fail = RuntimeError("router gone")
    reason = _run(ctrl, lambda: ctrl._start_worker("decode"))
    assert reason == "decode-0 did not start: the router did not take it: RuntimeError: router gone"
    assert ctrl.workers == {}
    assert killed == [ctrl._actor_classes["worker"].made["decode-0"]]


def test_a_worker_whose_router_add_timed_out_but_arrived_leaves_the_router(killed, monkeypatch):
    # The worker is killed: the router must not keep its address (nothing else would
    # take it out, and the port may be another worker's later).
    monkeypatch.setattr("tandem.deploy.ray_cluster.membership.CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr("tandem.deploy.ray_cluster.state.CALL_TIMEOUT_S", 0.2)
    ctrl = _controller()

    async def add_then_hang(pool, address):
        ctrl.router.members.add((pool, address))
        await asyncio.Event().wait()

    ctrl.router.add_worker.fn = add_then_hang
    reason = _run(ctrl, lambda: ctrl._start_worker("decode"))
    assert reason == "decode-0 did not start: the router did not take it: no answer within 0.2 s"
    assert ctrl.router.members == set() and ctrl.workers == {} and len(killed) == 1


def test_a_start_cancelled_while_its_placement_group_waits_frees_the_group(killed, monkeypatch):
    # tandem ray down (shutdown) cancels a top-up: a detached group left behind would
    # hold its resources on the cluster for good.
    class PendingGroup:
        async def ready(self):
            await asyncio.Event().wait()

    group = PendingGroup()
    monkeypatch.setattr("tandem.deploy.ray_cluster.placement.reserve",
                        lambda resources, name, namespace: ({}, group))  # fmt: skip
    ctrl = _controller()

    async def go():
        start = asyncio.ensure_future(ctrl._start_worker("decode"))
        await asyncio.sleep(0.1)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start

    _run(ctrl, go)
    assert killed == [group] and ctrl.workers == {}


def test_an_actor_whose_constructor_refused_its_settings_is_reported_by_that_message():
    from tandem.deploy.ray_cluster.state import _why
    from tandem.errors import ConfigError

    class TaskError(Exception):  # Ray's RayTaskError: the raised exception as ``cause``
        def __init__(self, cause):
            super().__init__("Traceback ...")
            self.cause = cause

    died = RuntimeError(TaskError(ConfigError("router.tls_cert_file: no such file")))
    assert _why(died) == "router.tls_cert_file: no such file"  # not Ray's 6-line traceback
    assert _why(RuntimeError("x")) == "RuntimeError: x"


def test_a_worker_not_serving_in_time_is_killed_and_the_resources_are_named(killed):
    ctrl = _controller(lambda w: setattr(w.info, "hang", True), startup_timeout_s=0.2)
    reason = _run(ctrl, lambda: ctrl._start_worker("decode"))
    assert reason == (
        "decode-0 did not start: not serving within 0.2 s (ray.startup_timeout_s): does "
        "the cluster have the resources {'CPU': 1.0, 'decode': 1} free? (`ray status` lists them)"
    )
    assert ctrl.workers == {} and len(killed) == 1


def test_a_worker_is_killed_and_freed_even_when_the_router_is_dead(killed):
    ctrl = _controller()

    async def go():
        assert await ctrl._start_worker("decode") is None
        w = ctrl.workers["decode-0"]
        w.placement_group = "pg-decode-0"
        ctrl.router.remove_worker.fail = RuntimeError("router dead")
        await ctrl._stop_worker(w, grace=0)
        return w

    w = _run(ctrl, go)
    assert w.handle.drain.calls == [(0,)]
    assert killed == [w.handle, "pg-decode-0"] and ctrl.workers == {}
    assert any("decode-0 not removed from the router" in e for e in ctrl.events)


def test_scale_names_the_workers_that_did_not_start_and_keeps_the_ones_that_did(killed):
    def setup(w):
        if w.name == "decode-3":
            w.info.fail = RuntimeError("CUDA out of memory")

    ctrl = _controller(setup)

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0, decode-1
        with pytest.raises(NotStarted) as err:
            await ctrl.scale(decode=3)
        return err.value

    err = _run(ctrl, go)
    assert str(err) == "decode-3 did not start: RuntimeError: CUDA out of memory"
    serving = sorted(n for n, w in ctrl.workers.items() if w.state == "serving")
    assert serving == ["decode-1", "decode-2", "prefill-0"]
    assert ctrl.router.members == {(w.pool, w.address) for w in ctrl.workers.values()}


def test_one_failing_job_does_not_hide_the_others_in_a_reconcile(killed):
    ctrl = _controller()

    async def go():
        await ctrl._reconcile()
        ctrl.targets = {"prefill": 2, "decode": 0}

        async def broken_stop(w, grace):
            raise ValueError(f"cannot stop {w.name}")

        ctrl._stop_worker = broken_stop
        return await ctrl._reconcile()

    assert _run(ctrl, go) == ["ValueError: cannot stop decode-1"]
    assert ctrl.workers["prefill-2"].state == "serving"  # the start ran to its end


def test_stats_read_before_a_restart_announcement_do_not_undo_it(killed):
    ctrl = _controller()

    async def go():
        assert await ctrl._start_worker("decode") is None
        fake = ctrl._actor_classes["worker"].made["decode-0"]
        stale = {**fake.current, "running": 0, "queue_depth": 0}

        async def stats_across_a_restart():
            # The worker answered, then crashed and restarted; its announcement
            # arrives before the monitor reads the old answer.
            await ctrl.worker_started(fake.restart("i2", 4999, started_at=2.0))
            return stale

        fake.stats.fn = stats_across_a_restart
        await ctrl._monitor_once()
        return ctrl.workers["decode-0"]

    w = _run(ctrl, go)
    assert (w.address, w.info["incarnation"], w.restarts) == ("10.0.0.1:4999", "i2", 1)
    assert ctrl.router.members == {("decode", "10.0.0.1:4999")}


def test_an_unplaceable_router_fails_start_with_its_resources_named(killed, monkeypatch):
    import ray

    router = FakeRouter()
    router.info.hang = True

    class RouterClass:
        def options(self, **options):
            return self

        def remote(self, config, credentials, log_format):
            return router

    monkeypatch.setattr(ray, "remote", lambda cls: RouterClass())
    ctrl = Controller(RayDeployConfig(request_nodes=False, router_timeout_s=0.2))
    with pytest.raises(NotStarted) as err:
        asyncio.run(ctrl.start())
    assert str(err.value) == (
        "the router did not start: not serving within 0.2 s (ray.router_timeout_s): does the "
        "cluster have the resources {'CPU': 1.0, 'node:__internal_head__': 0.001} free? "
        "(`ray status` lists them)"
    )
    assert killed == [router] and ctrl.router is None and ctrl.workers == {}


def test_an_asyncio_timeout_is_reported_as_one_on_python_3_10(monkeypatch):
    from tandem.deploy.ray_cluster.config import ActorResources
    from tandem.deploy.ray_cluster.controller import _why

    class Py310Timeout(Exception):  # 3.10's asyncio.TimeoutError: not the builtin one
        pass

    monkeypatch.setattr(asyncio, "TimeoutError", Py310Timeout)
    reason = _why(Py310Timeout(), 5, "ray.startup_timeout_s", ActorResources(num_cpus=2))
    assert reason.startswith("not serving within 5 s (ray.startup_timeout_s)")


def test_a_restart_the_live_router_did_not_take_is_retried_by_the_monitor(killed):
    ctrl = _controller()
    ctrl.targets = {"prefill": 0, "decode": 1}  # only the one worker below

    async def go():
        assert await ctrl._start_worker("decode") is None
        fake = ctrl._actor_classes["worker"].made["decode-0"]
        ctrl.router.remove_worker.fail = RuntimeError("router busy")
        fake.restart("i2", 4999, started_at=2.0)
        await ctrl._monitor_once()  # sees the restart; the router takes neither call
        assert ctrl.router.members == {("decode", "10.0.0.1:4000")}
        await ctrl._monitor_once()  # still failing: tried again, nothing lost
        assert len(ctrl.router.remove_worker.calls) == 2
        ctrl.router.remove_worker.fail = None
        await ctrl._monitor_once()

    _run(ctrl, go)
    assert ctrl.router.members == {("decode", "10.0.0.1:4999")}
    assert ctrl.router_info == {"incarnation": "r1"}  # the router itself never restarted


def test_a_restarted_router_gets_every_worker_even_when_one_add_hangs(killed, monkeypatch):
    from tandem.deploy.ray_cluster import membership

    monkeypatch.setattr(membership, "CALL_TIMEOUT_S", 0.2)
    ctrl = _controller()
    hung: list[str] = []

    async def add(pool, addr):
        if addr.endswith(":4001") and not hung:  # decode-1's first add never answers
            hung.append(addr)
            await asyncio.Event().wait()
        ctrl.router.members.add((pool, addr))

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0 on :4000, decode-1 on :4001
        ctrl.router.members.clear()  # the router restarted
        ctrl.router.info.fn = lambda: {"address": "head:50051", "incarnation": "r2"}
        ctrl.router.add_worker.fn = add
        await ctrl._monitor_once()
        assert ctrl.router.members == {("prefill", "10.0.0.1:4000")}
        await ctrl._monitor_once()  # the same incarnation now, but decode-1 is still owed

    _run(ctrl, go)
    assert hung == ["10.0.0.1:4001"]
    assert ctrl.router.members == {("prefill", "10.0.0.1:4000"), ("decode", "10.0.0.1:4001")}
    assert ctrl.router_info["incarnation"] == "r2"


def test_the_monitor_tops_up_a_short_pool_one_attempt_at_a_time(killed):
    gate = asyncio.Event()

    def setup(w):
        if w.name == "decode-1":
            w.info.fail = RuntimeError("CUDA out of memory")
        if w.name == "decode-2":
            answer = w.info.fn

            async def info_when_let_through():
                await gate.wait()
                return answer()

            w.info.fn = info_when_let_through

    ctrl = _controller(setup)
    made = ctrl._actor_classes["worker"].made

    async def go():
        assert await ctrl._reconcile() == [
            "decode-1 did not start: RuntimeError: CUDA out of memory"
        ]
        await ctrl._monitor_once()  # starts decode-2, which waits at the gate
        first = ctrl._top_up["decode"]
        await ctrl._monitor_once()  # decode-2 is still starting: nothing more is started
        assert ctrl._top_up["decode"] is first
        assert sorted(made) == ["decode-1", "decode-2", "prefill-0"]
        gate.set()
        assert await first == []
        await ctrl._monitor_once()  # at the target: nothing to do
        assert ctrl._top_up == {"decode": first}

    _run(ctrl, go)
    assert sorted(made) == ["decode-1", "decode-2", "prefill-0"]
    assert ctrl.workers["decode-2"].state == "serving"
    assert ctrl.router.members == {(w.pool, w.address) for w in ctrl.workers.values()}


def test_a_colocated_deployment_runs_no_prefill_pool_and_scales_only_decode(killed):
    from tandem.config import DisaggregationConfig, RouterConfig
    from tandem.deploy.ray_cluster.config import ActorResources
    from tandem.errors import ConfigError

    ctrl = _controller(
        router=RouterConfig(host="0.0.0.0", disaggregation=DisaggregationConfig(mode="never")),
        prefill_pool=ActorResources(replicas=0, resources={"prefill": 1}),
        decode_pool=ActorResources(replicas=2, resources={"decode": 1}),
    )
    made = ctrl._actor_classes["worker"].made

    async def go():
        assert await ctrl._reconcile() == []
        await ctrl.scale(decode=3)
        with pytest.raises(ConfigError, match="has no prefill pool"):
            await ctrl.scale(prefill=1)

    _run(ctrl, go)
    assert sorted(made) == ["decode-0", "decode-1", "decode-2"]
    assert {pool for pool, _ in ctrl.router.members} == {"decode"}
    assert ctrl.autoscaler.pools == ("decode",)  # nothing grows a prefill pool back


async def _serving_and_adopted(ctrl: Controller) -> tuple[asyncio.Future, asyncio.Event]:
    """decode-0 serving and routed, decode-1 adopted after a controller restart and not
    answering until the event is set; (the adoption, the event)."""
    from tandem.deploy.ray_cluster import adoption
    from tandem.deploy.ray_cluster.state import _Worker
    from tests.deploy.fake_actors import FakeWorker

    ctrl.targets.update(prefill=0, decode=2)
    first = FakeWorker("decode", "decode-0", port=5000)
    address = first.current["address"]
    ctrl.workers["decode-0"] = _Worker(
        "decode-0", "decode", first, state="serving", info=first.current, routed=address
    )
    await ctrl.router.add_worker.remote("decode", address)
    slow, answer = FakeWorker("decode", "decode-1", port=5001), asyncio.Event()

    async def info_later():
        await answer.wait()
        return dict(slow.current)

    slow.info.fn = info_later
    ctrl.workers["decode-1"] = adopted = _Worker("decode-1", "decode", slow)
    ctrl._next_id = 2
    adopting = asyncio.ensure_future(adoption.adopt(ctrl, adopted))
    await asyncio.sleep(0.05)
    return adopting, answer


def test_a_worker_adopted_but_not_answering_yet_counts_toward_its_pool(killed):
    # After a controller restart a worker whose node restarts it is "starting" until it
    # answers; a scale or autoscale round meanwhile must not start a replacement.
    ctrl = _controller()

    async def go():
        adopting, answer = await _serving_and_adopted(ctrl)
        await ctrl.scale(decode=2)
        answer.set()
        await adopting
        return sorted(n for n, w in ctrl.workers.items() if w.state == "serving")

    assert _run(ctrl, go) == ["decode-0", "decode-1"]
    assert ctrl._actor_classes["worker"].made == {}  # nothing started


def test_a_worker_ray_will_not_restart_is_replaced_at_the_next_round(killed, monkeypatch):
    # Its restarts used up (or none allowed): Ray says DEAD at once, and waiting
    # startup_timeout_s (600 s) for it left the pool short that long.
    from tandem.deploy.ray_cluster import recovery

    ctrl = _controller()
    made = ctrl._actor_classes["worker"].made

    async def go():
        assert await ctrl._reconcile() == []
        dead = made["decode-1"]
        dead.stats.fail = RuntimeError("ActorDiedError")
        monkeypatch.setattr(recovery, "dead_for_good", lambda handle: handle is dead)
        await ctrl._monitor_once()
        assert await ctrl._top_up["decode"] == []

    _run(ctrl, go)
    assert sorted(ctrl.workers) == ["decode-2", "prefill-0"]
    assert any("decode-1 lost: Ray will not restart it" in e for e in ctrl.events)


def test_autoscaling_goes_on_while_a_worker_waits_for_a_node(killed):
    # A start that waits for a node (up to startup_timeout_s, 600 s) held the one lock
    # of every resize, and each autoscale round returned at once while it was held: a
    # prefill queue of 40 on one worker grew nothing, for as long as the start waited.
    from tandem.deploy.autoscale import AutoscaleConfig, PoolPolicy
    from tandem.deploy.ray_cluster.config import ActorResources

    def setup(w):
        if w.name == "decode-3":  # no node has room for a third decode worker
            w.info.hang = True

    policy = AutoscaleConfig(enabled=True, scale_up_cooldown_s=0, scale_down_window_s=0,
                             prefill=PoolPolicy(1, 6, 2.0))  # fmt: skip
    ctrl = _controller(setup, decode_pool=ActorResources(replicas=2, resources={"decode": 1}),
                       autoscale=policy)  # fmt: skip
    made = ctrl._actor_classes["worker"].made

    def load(name: str, used: int = 0, queue: int = 0) -> None:
        fake = made[name]
        fake.stats.fn = lambda: {**fake.current, "running": 0, "queue_depth": queue,
                                 "kv_blocks_used": used, "kv_blocks_total": 100}  # fmt: skip

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0, decode-1, decode-2
        load("decode-1", used=90)
        load("decode-2", used=90)
        load("prefill-0")
        await ctrl._monitor_once()
        await ctrl._autoscale_once()  # decode 2 -> 3: decode-3 waits for a node
        await asyncio.sleep(0.1)
        assert ctrl.targets["decode"] == 3 and ctrl.resizing("decode")
        load("prefill-0", queue=40)
        await ctrl._monitor_once()
        await asyncio.wait_for(ctrl._autoscale_once(), 2)
        await asyncio.wait_for(ctrl._resizes["prefill"], 5)
        assert ctrl.targets == {"prefill": 6, "decode": 3}
        assert sorted(made) == ["decode-1", "decode-2", "decode-3", "prefill-0", "prefill-4",
                                "prefill-5", "prefill-6", "prefill-7", "prefill-8"]  # fmt: skip
        assert ctrl.resizing("decode")  # still waiting, and not started twice
        await ctrl.shutdown(grace=0)

    _run(ctrl, go)


def test_a_scale_down_whose_router_removal_failed_is_removed_later(killed):
    # The worker was drained and killed anyway, and its address stayed in the router,
    # polled for ever (and another worker could get its port later).
    from tandem.deploy.ray_cluster.config import ActorResources

    ctrl = _controller(decode_pool=ActorResources(replicas=2, resources={"decode": 1}))

    async def go():
        assert await ctrl._reconcile() == []
        ctrl.router.remove_worker.fail = TimeoutError()
        ctrl.targets["decode"] = 1
        assert await ctrl._reconcile() == []
        assert len(ctrl.router.members) == 3  # the stopped one's address stayed
        await ctrl._monitor_once()  # the router still does not answer: owed still
        ctrl.router.remove_worker.fail = None
        await ctrl._monitor_once()

    _run(ctrl, go)
    assert ctrl.router.members == {(w.pool, w.address) for w in ctrl.workers.values()}
    assert ctrl._owed_removals == set()


def test_a_scale_of_one_pool_does_not_wait_for_the_others_stuck_start(killed):
    # It reconciled every pool: `scale --prefill 2` waited out a decode worker's start
    # (startup_timeout_s, twice), then failed naming that decode worker.
    from tandem.deploy.ray_cluster.config import ActorResources

    def setup(w):
        if w.pool == "decode" and w.name != "decode-1":
            w.info.hang = True  # no node has room for a second decode worker

    ctrl = _controller(setup, decode_pool=ActorResources(replicas=1, resources={"decode": 1}))

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0, decode-1
        ctrl.targets["decode"] = 2
        ctrl._resize_soon("decode")  # decode-2 waits for a node
        await asyncio.sleep(0.1)
        await asyncio.wait_for(ctrl.scale(prefill=2), 5)
        assert sorted(w.name for w in ctrl.workers.values() if w.state == "serving") == [
            "decode-1", "prefill-0", "prefill-3"]  # fmt: skip
        await ctrl.shutdown(grace=0)

    _run(ctrl, go)


def test_an_owed_router_removal_spares_a_new_worker_on_the_same_address(killed, monkeypatch):
    # The owed removals were checked against the workers once, before calls that may
    # take CALL_TIMEOUT_S each: a worker started meanwhile on a stopped one's port was
    # taken out of the router, and never put back (the controller thought it routed).
    from tandem.deploy.ray_cluster import membership
    from tandem.deploy.ray_cluster.config import ActorResources

    monkeypatch.setattr(membership, "CALL_TIMEOUT_S", 0.5)

    def setup(w):
        if w.name == "decode-4":  # given decode-3's old port
            w.current = w._info("i1", 4003, 1.0)

    ctrl = _controller(setup, decode_pool=ActorResources(replicas=3, resources={"decode": 1}))
    router = ctrl.router

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0 :4000, decode-1..3 :4001..4003
        router.remove_worker.fail = TimeoutError()
        await ctrl.scale(decode=1)  # decode-2 and decode-3 stopped, their removals owed
        router.remove_worker.fail = None
        remove = router.remove_worker.fn

        async def slow_remove(pool, address):
            await asyncio.sleep(0.3)
            return remove(pool, address)

        router.remove_worker.fn = slow_remove

        async def scale_up_meanwhile():  # while the monitor round settles the removals
            await asyncio.sleep(0.1)
            await ctrl.scale(decode=2)  # decode-4, on :4003

        await asyncio.gather(ctrl._monitor_once(), scale_up_meanwhile())
        await ctrl._monitor_once()
        d4 = ctrl.workers["decode-4"]
        assert ("decode", d4.address) in router.members and d4.routed == d4.address
        assert router.members == {(w.pool, w.address) for w in ctrl.workers.values()}

    _run(ctrl, go)


def test_a_lower_target_ends_a_start_that_waits_for_a_node(killed):
    # The monitor's top-up held the pool's lock while its start waited up to
    # startup_timeout_s (600 s) for a node: `scale --decode 2` waited it out.
    from tandem.deploy.ray_cluster.config import ActorResources

    def setup(w):
        if w.name == "decode-3":
            w.info.hang = True  # no node has room

    ctrl = _controller(setup, decode_pool=ActorResources(replicas=2))

    async def go():
        assert await ctrl._reconcile() == []  # prefill-0, decode-1, decode-2
        ctrl.targets["decode"] = 3
        await ctrl._monitor_once()  # the top-up starts decode-3, which waits
        await asyncio.sleep(0.1)
        await asyncio.wait_for(ctrl.scale(decode=2), 5)
        assert "decode-3" not in ctrl.workers and ctrl._top_up["decode"].cancelled()
        await ctrl._monitor_once()  # at the target: nothing started
        assert sorted(ctrl.workers) == ["decode-1", "decode-2", "prefill-0"]

    _run(ctrl, go)


def test_workers_past_a_target_lowered_while_they_were_adopted_are_drained(killed):
    # A scale-down drains serving workers only: one still restarting when the target
    # was lowered served on past it for good once it answered.
    ctrl = _controller()

    async def go():
        adopting, answer = await _serving_and_adopted(ctrl)
        await ctrl.scale(decode=1)
        answer.set()
        await adopting
        await ctrl._monitor_once()
        await ctrl._resizes["decode"]
        serving = [n for n, w in ctrl.workers.items() if w.state == "serving"]
        assert len(serving) == 1 and len(ctrl.router.members) == 1

    _run(ctrl, go)


def test_lost_workers_are_freed_together_without_a_drain(killed):
    # Each was drained first, and a call to an actor Ray cannot place waits: every lost
    # worker held the monitor round (router syncs, targets file, replacements) 30 s,
    # one after another.
    from tandem.deploy.ray_cluster.config import ActorResources

    ctrl = _controller(decode_pool=ActorResources(replicas=3), startup_timeout_s=0.01)
    made = ctrl._actor_classes["worker"].made

    async def go():
        assert await ctrl._reconcile() == []
        lost = ["decode-1", "decode-2"]
        for name in lost:
            made[name].stats.hang = made[name].drain.hang = True  # no answer, ever
        await asyncio.wait_for(ctrl._monitor_once(), 20)  # a hang guard: 60 s before
        assert [made[n].drain.calls for n in lost] == [[], []]
        assert sorted(ctrl.workers) == ["decode-3", "prefill-0"]
        assert {made[n] for n in lost} <= set(killed)
        assert [e for e in ctrl.events if "lost" in e] and ctrl._top_up["decode"]
        ctrl._top_up["decode"].cancel()

    _run(ctrl, go)


def test_a_top_up_cancelled_during_its_router_add_leaves_the_router(killed):
    # A lowered target cancels the top-up; the router's add_worker, already sent, runs
    # all the same: the killed worker's address stayed routed for good.
    from tandem.deploy.ray_cluster.config import ActorResources

    ctrl = _controller(decode_pool=ActorResources(replicas=2))
    made = ctrl._actor_classes["worker"].made

    async def go():
        assert await ctrl._reconcile() == []
        add = ctrl.router.add_worker.fn

        async def add_slowly(pool, address):
            ctrl.router.members.add((pool, address))  # arrived; the answer is late
            await asyncio.sleep(1.0)

        ctrl.router.add_worker.fn = add_slowly
        ctrl.targets["decode"] = 3
        await ctrl._monitor_once()  # the top-up starts decode-3 and adds it
        await asyncio.sleep(0.1)
        ctrl.router.add_worker.fn = add
        await asyncio.wait_for(ctrl.scale(decode=2), 5)
        await ctrl._monitor_once()
        assert made["decode-3"] in killed
        assert ctrl.router.members == {(w.pool, w.address) for w in ctrl.workers.values()}

    _run(ctrl, go)
