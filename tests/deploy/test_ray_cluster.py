"""Tandem on a local Ray head (tiny-random), driven as an operator and clients do.

One deployment for the module: ``tandem ray up`` (a subprocess, which starts its
own Ray head), then scaling under load, a drain with a stream in flight, a
killed worker, and ``tandem ray down``. The tests run in file order and each
leaves the pools as the next one expects. Afterwards no process of that Ray head
may be left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]

CONFIG = """\
engine: {model: tiny-random, num_blocks: 256, dtype: float32, device: cpu}
router: {port: 0}
ray:
  prefill: {num_cpus: 1}
  decode: {num_cpus: 1}
  router: {num_cpus: 0.5}
  monitor_interval_s: 0.5
  drain_timeout_s: 90  # the drain test: its long stream must end on its own worker
  metrics: true
"""


def _tandem(*args: str, home: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI as an operator on a fresh machine runs it: an empty home directory (no
    Ray token, no caches) and no Ray authentication variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "HOME": str(home)},
    )


class Deployment:
    def __init__(self, tmp: Path, config: str = CONFIG) -> None:
        self.home = tmp / "home"
        self.home.mkdir()
        self.state_file = tmp / "ray-state.json"
        self.config_file = tmp / "ray.yaml"
        self.targets_file = tmp / "targets.json"
        self.config_file.write_text(config + f"  metrics_targets_file: {self.targets_file}\n")
        self.router = ""
        self.head_procs: list = []

    def status(self) -> dict:
        from tandem.deploy.ray_cluster.launch import status

        return status(self.state_file)

    def scale(self, **sizes) -> dict:
        from tandem.deploy.ray_cluster.launch import scale

        return scale(self.state_file, sizes.get("prefill"), sizes.get("decode"))

    def workers(self, pool: str, st: dict | None = None) -> list[dict]:
        return [w for w in (st or self.status())["workers"] if w["pool"] == pool]

    def generate(self, prompt: str = "Hello there", **sampling) -> tuple[str, list]:
        with TandemClient(self.router, timeout=120) as client:
            chunks = list(client.generate(prompt=prompt, **sampling))
        return chunks[-1].finish_reason, [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    with deployment(Deployment(tmp_path_factory.mktemp("ray"))) as d:
        yield d


@contextlib.contextmanager
def deployment(d: Deployment):
    """``tandem ray up`` of ``d``'s config; on exit ``down``, and no process left."""
    from tandem.deploy.ray_cluster.head import head_processes, read_state
    from tandem.deploy.ray_cluster.launch import connected

    started = time.monotonic()
    up = _tandem(
        "ray",
        "up",
        "--config",
        str(d.config_file),
        "--state-file",
        str(d.state_file),
        home=d.home,  # no --insecure: a local head's router serves on loopback
    )
    assert up.returncode == 0, up.stderr[-3000:]
    d.router = re.search(r"serving tiny-random on (\S+)", up.stdout).group(1)
    state = read_state(d.state_file)
    d.head_procs = head_processes(state)
    print(f"ray up took {time.monotonic() - started:.1f} s")
    # One driver connection for the module: status and scale reuse it (fast polling).
    with connected(state):
        yield d
    # Whatever the tests did, nothing may survive `down`: not the head's daemons,
    # nor any actor process started since `up` (all are the head's descendants).
    procs = d.head_procs + head_processes(read_state(d.state_file))
    down = _tandem("ray", "down", "--state-file", str(d.state_file), home=d.home)
    assert down.returncode == 0, down.stderr[-3000:]
    _assert_gone(procs)


def _assert_gone(procs: list, within_s: float = 30.0) -> None:
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"


def _wait_for(predicate, what: str, timeout_s: float = 60.0, interval_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}; last: {value!r}")


def test_up_serves_a_generation_through_the_router_with_pools_placed_by_resource(dep):
    finish, tokens = dep.generate(max_tokens=8, ignore_eos=True)
    assert finish == "length" and len(tokens) == 8
    # A local head's router serves this machine: no TLS was given, nor --insecure.
    assert dep.router.startswith("127.0.0.1:")
    # Each worker served it (the controller's numbers are polled every 0.5 s).
    st = _wait_for(
        lambda: (st := dep.status()) and all(w.get("served") for w in st["workers"]) and st,
        "both workers' served counts",
        timeout_s=30,
    )
    assert st["router"] == dep.router and st["targets"] == {"prefill": 1, "decode": 1}
    for pool in ("prefill", "decode"):
        (w,) = dep.workers(pool, st)
        assert w["state"] == "serving" and w["node_ip"] and w["served"] == 1
        assert w["resources"].get(pool) == 1  # placed on the pool's custom resource
    assert {(w["pool"], w["address"]) for w in st["router_workers"]} == {
        (w["pool"], w["address"]) for w in st["workers"]
    }
    # `up` handed the actors the cluster's credentials: the router reaches the workers
    # over mutual TLS (it just did), and a caller without them is refused.
    for w in st["workers"]:
        assert _plaintext_status(w["pool"], w["address"]) == grpc.StatusCode.UNAVAILABLE


def _plaintext_status(pool: str, address: str) -> grpc.StatusCode:
    from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc

    stubs = {"prefill": worker_pb2_grpc.PrefillWorkerStub,
             "decode": worker_pb2_grpc.DecodeWorkerStub}  # fmt: skip
    with grpc.insecure_channel(address) as channel:
        try:
            stubs[pool](channel).Status(worker_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_scale_decode_up_under_load_loses_no_request_and_the_new_worker_serves(dep):
    stop = threading.Event()
    results: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def client_loop(i: int) -> None:
        while not stop.is_set():
            try:
                finish, tokens = dep.generate(f"stream {i}", max_tokens=24, ignore_eos=True)
                results.append((finish, len(tokens)))
            except BaseException as exc:  # noqa: BLE001 - every failure counts
                errors.append(exc)

    with ThreadPoolExecutor(4) as pool:
        for i in range(4):
            pool.submit(client_loop, i)
        time.sleep(1.0)
        st = dep.scale(decode=2)
        (new,) = [w for w in dep.workers("decode", st) if w["name"] != "decode-1"]
        served_before = new.get("served", 0)

        def new_worker_served():  # counts the controller polls: while the clients go on
            (now,) = [w for w in dep.workers("decode") if w["name"] == new["name"]]
            return now["state"] == "serving" and now.get("served", 0) > served_before

        try:
            _wait_for(new_worker_served, "the new worker serving requests", timeout_s=60)
        finally:
            stop.set()
    assert not errors, errors[:3]
    assert results and all(r == ("length", 24) for r in results)


def test_scale_down_drains_a_worker_with_a_stream_in_flight_and_the_stream_completes(dep):
    # Idle first: the status numbers are polled, so "running" seen below is then ours.
    decode = _wait_for(
        lambda: (ws := dep.workers("decode")) and all(w.get("running") == 0 for w in ws) and ws,
        "the previous test's streams to end",
        timeout_s=20,
    )
    assert len(decode) == 2
    with ThreadPoolExecutor(2) as pool:
        streams = [
            # 3000 tokens hold most of a worker's 256 blocks of 16: one stream per worker.
            pool.submit(dep.generate, f"long {i}", max_tokens=3000, ignore_eos=True)
            for i in range(2)
        ]

        def both_running():
            st = dep.status()
            return all(w.get("running") == 1 for w in dep.workers("decode", st)) and st

        before = _wait_for(
            both_running, "a stream on each decode worker", timeout_s=20, interval_s=0.1
        )
        served = {w["name"]: w["served"] for w in dep.workers("decode", before)}
        st = dep.scale(decode=1)  # returns once the removed worker has drained
        outcomes = [s.result(timeout=120) for s in streams]
    assert [(f, len(t)) for f, t in outcomes] == [("length", 3000)] * 2
    (kept,) = dep.workers("decode", st)
    (removed,) = [w for w in decode if w["name"] != kept["name"]]
    assert removed["address"] not in {w["address"] for w in st["router_workers"]}
    # Its stream finished on it during the drain: one more served than when it began.
    drained = [e for e in st["events"] if f"{removed['name']} drained" in e]
    assert drained and f"({served[removed['name']] + 1} requests served)" in drained[0]


def test_a_killed_worker_is_restarted_by_ray_and_used_by_the_router_again(dep):
    (w,) = dep.workers("decode")
    os.kill(w["pid"], signal.SIGKILL)

    def restarted():
        st = dep.status()
        (now,) = dep.workers("decode", st)
        healthy = {(r["address"], r["healthy"]) for r in st["router_workers"]}
        ok = now["restarts"] == 1 and now["state"] == "serving"
        return ok and (now["address"], True) in healthy and (now, st)

    now, st = _wait_for(restarted, "the decode worker's restart", timeout_s=90)
    assert now["pid"] != w["pid"] and now["address"] != w["address"]
    assert w["address"] not in {r["address"] for r in st["router_workers"]}
    for i in range(3):
        assert dep.generate(f"after restart {i}", max_tokens=6, ignore_eos=True)[0] == "length"
    # The restarted worker served them (its count starts again from zero).
    after = _wait_for(
        lambda: [w for w in dep.workers("decode") if w.get("served", 0) >= 3],
        "the restarted worker's served count (polled every 0.5 s)",
        timeout_s=30,
    )
    assert after[0]["pid"] == now["pid"]


def test_metrics_targets_file_follows_the_actors_and_each_target_serves_metrics(dep):
    import json

    from tandem.metrics.scrape import scrape, total

    def current():
        st = dep.status()
        groups = json.loads(dep.targets_file.read_text())
        named = {g["labels"]["process"]: g["targets"][0] for g in groups}
        serving = {w["name"]: w["metrics_address"] for w in st["workers"]
                   if w["state"] == "serving"}  # fmt: skip
        want = {"router": st["router_metrics"], **serving}
        return named == want and all(want.values()) and (named, st)

    # The restarted decode worker's new address included (the controller rewrites the file).
    named, st = _wait_for(current, "the targets file to list every serving actor", 30)
    assert st["metrics_targets_file"] == str(dep.targets_file)
    router = scrape(named.pop("router"))
    assert total(router, "tandem_router_requests_total", code="OK") >= 3
    for name, address in named.items():
        samples = scrape(address)
        role = "decode" if name.startswith("decode") else "prefill"
        assert total(samples, "tandem_worker_kv_blocks_capacity", role=role) == 256, name
    out = _tandem("ray", "status", "--state-file", str(dep.state_file), home=dep.home)
    assert str(dep.targets_file) in out.stdout and "metrics" in out.stdout


def test_status_cli_then_down_leaves_no_tandem_actors_and_no_processes(dep):
    from tandem.deploy.ray_cluster.head import head_processes, read_state
    from tandem.deploy.ray_cluster.launch import connected, stop_deployment, tandem_actors

    out = _tandem("ray", "status", "--state-file", str(dep.state_file), home=dep.home)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"decode\s+decode-\d+\s+serving", out.stdout)
    assert re.search(r"prefill\s+prefill-0\s+serving", out.stdout)

    state = read_state(dep.state_file)
    procs = head_processes(state)  # the actors started since `up` included
    assert sum("WorkerActor" in p.name() or "WorkerActor" in " ".join(p.cmdline()) for p in procs)
    stopped = stop_deployment(state, 5)
    assert stopped
    with connected(state) as ray:
        assert tandem_actors(ray, state["namespace"]) == []
    ray.shutdown()  # this driver's connection goes before the head does
    down = _tandem("ray", "down", "--state-file", str(dep.state_file), home=dep.home)
    assert down.returncode == 0 and "local Ray head" in down.stderr
    assert not dep.state_file.exists()
    _assert_gone(procs + dep.head_procs)
