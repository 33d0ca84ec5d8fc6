"""Tandem on a multi-node Ray cluster on this machine, made with deploy/start-*.sh.

A head, a prefill node and two decode nodes (one with two slots, so a decode worker
can be restored elsewhere), each a ``ray start --block`` of its own (own temp dir,
free ports, token authentication with the token the head script made). Then
``tandem ray up --address`` and, in file order: placement by node; a decode node
killed (its whole process tree, SIGKILL) and its worker restored on the other
decode node; the only prefill node killed, ``status`` naming the missing
resource, and the pool filled again when the node rejoins; the controller's
process killed, and the restarted controller adopting every worker as it was,
with scale and autoscaling working again. Afterwards no process of any node may
be left.

Opt-in (``TANDEM_MULTINODE=1``, or ``deploy/test-multinode.sh``): it needs minutes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tandem.client import TandemClient
from tests.deploy.test_ray_cluster import _assert_gone, _tandem, _wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
    # 2 to 6 minutes on two cores (four Ray nodes), with the load: too long for `make test`.
    pytest.mark.skipif(
        not os.environ.get("TANDEM_MULTINODE"),
        reason="opt-in: TANDEM_MULTINODE=1, or deploy/test-multinode.sh",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
STORE = str(128 * 2**20)
# Autoscaling on, with bounds that keep the pools where the tests put them while
# idle (prefill 1, decode 2); after the controller's restart a manual scale-up of
# prefill is shrunk back by the autoscaler (a short scale-down cooldown).
CONFIG = """\
engine: {model: tiny-random, num_blocks: 128, dtype: float32, device: cpu}
router: {port: 0}
ray:
  prefill: {num_cpus: 0.5}
  decode: {num_cpus: 0.5}
  router: {num_cpus: 0.25}
  monitor_interval_s: 0.5
  startup_timeout_s: 300
  drain_timeout_s: 5
  autoscale:
    enabled: true
    interval_s: 1
    prefill: {min_replicas: 1, max_replicas: 2, target: 2}
    decode: {min_replicas: 2, max_replicas: 3, target: 0.7}
    scale_up_cooldown_s: 0
    scale_down_cooldown_s: 4
"""


class Cluster:
    """Ray nodes started with the deploy scripts; each is a process tree we own."""

    def __init__(self) -> None:
        # Short: Ray's socket paths under a node's temp dir are limited to ~107 chars.
        self.root = Path(tempfile.mkdtemp(prefix="tmn-", dir="/tmp"))
        self.token = self.root / "token"
        self.home = self.root / "home"
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            **env,
            "HOME": str(self.home),
            "PATH": f"{bin_dir}:{env.get('PATH', '')}",
            "PYTHON": sys.executable,
            # The head declares a node dead after ~3 s without answers (Ray's default ~15 s).
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }
        self.nodes: dict[str, subprocess.Popen] = {}
        self.procs: list = []  # every process of every node, seen at some time
        self.address = ""

    def start(self, name: str, script: str, *args: str) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.nodes[name] = subprocess.Popen(
            [str(ROOT / "deploy" / script), *args, "--node-ip", "127.0.0.1",
             "--object-store-memory", STORE, "--temp-dir", str(self.root / name),
             "--token-file", str(self.token), "--", "--block"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )  # fmt: skip

    def start_head(self) -> None:
        self.start("head", "start-head.sh", "--port", "0", "--num-cpus", "1")
        log = self.root / "head.log"
        found = _wait_for(
            lambda: re.search(r"Ray head at (\S+);", log.read_text()), "the head's address", 30
        )
        self.address = found.group(1)
        _wait_for(lambda: (self.root / "head" / "ray_current_cluster").exists(), "the head", 60)

    def start_worker(self, name: str, pool: str, slots: int, cpus: int) -> None:
        self.start(name, "start-worker.sh", "--address", self.address, "--num-cpus", str(cpus),
                   pool, str(slots))  # fmt: skip

    def node_ids(self) -> dict[str, str]:
        """Alive node id per node name (the nodes' temp dirs are in their socket paths)."""
        import ray

        out = {}
        for n in ray.nodes():
            if n["Alive"]:
                name = Path(n["ObjectStoreSocketName"]).relative_to(self.root).parts[0]
                out[name] = n["NodeID"]
        return out

    def tree(self, name: str) -> list:
        import psutil

        try:
            p = psutil.Process(self.nodes[name].pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, name: str) -> None:
        """The whole node at once, as when its machine dies."""
        procs = self.tree(name)
        self.procs += procs
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.nodes[name].wait(10)

    def stop_all(self) -> None:
        import psutil

        for name in list(self.nodes):
            self.kill(name)
        # Anything that left its node's process tree still names the node's temp dir.
        strays = []
        for p in psutil.process_iter(["cmdline"]):
            if str(self.root) in " ".join(p.info["cmdline"] or []):
                strays.append(p)
                p.kill()
        _assert_gone(self.procs + strays)
        shutil.rmtree(self.root, ignore_errors=True)

    def tandem(self, *args: str) -> subprocess.CompletedProcess:
        return _tandem(*args, "--state-file", str(self.root / "state.json"), home=self.home)


def _generate(router: str, n: int = 3) -> None:
    for i in range(n):
        with TandemClient(router, timeout=60) as client:
            chunks = list(client.generate(prompt=f"hi {i}", max_tokens=4, ignore_eos=True))
        assert chunks[-1].finish_reason == "length"


@pytest.fixture(scope="module")
def cluster():
    from tandem.deploy.ray_cluster.launch import connected

    c = Cluster()
    environ = dict(os.environ)  # `connected` sets Ray's authentication variables
    try:
        c.start_head()
        state = {"address": c.address, "namespace": "tandem", "auth_mode": "token",
                 "auth_token_file": str(c.token)}  # fmt: skip
        # This test's driver attaches to the head's raylet: connected before the others join.
        with connected(state):
            c.start_worker("p1", "prefill", slots=2, cpus=1)
            c.start_worker("d1", "decode", slots=1, cpus=1)
            c.start_worker("d2", "decode", slots=2, cpus=1)
            _wait_for(lambda: len(c.node_ids()) == 4, "four alive nodes", 90)
            (c.root / "ray.yaml").write_text(CONFIG)
            up = c.tandem("ray", "up", "--address", c.address, "--token-file", str(c.token),
                          "--config", str(c.root / "ray.yaml"), "--decode", "2",
                          "--insecure")  # fmt: skip
            assert up.returncode == 0, up.stderr[-3000:]
            c.router = re.search(r"serving tiny-random on (\S+)", up.stdout).group(1)
            yield c
            down = c.tandem("ray", "down", "--grace", "1")
            assert down.returncode == 0, down.stderr[-3000:]
    finally:
        c.stop_all()
        os.environ.clear()
        os.environ.update(environ)


def _status(c: Cluster) -> dict:
    from tandem.deploy.ray_cluster.launch import status

    return status(c.root / "state.json")


def _workers(st: dict, pool: str) -> list[dict]:
    return [w for w in st["workers"] if w["pool"] == pool]


def test_each_pool_runs_only_on_nodes_offering_its_resource(cluster):
    ids = cluster.node_ids()
    st = _status(cluster)
    (prefill,) = _workers(st, "prefill")
    decode = _workers(st, "decode")
    assert prefill["node_id"] == ids["p1"]
    # Spread over the two decode nodes, none on the head or the prefill node.
    assert sorted(w["node_id"] for w in decode) == sorted([ids["d1"], ids["d2"]])
    assert st["controller"]["node_id"] == ids["head"]
    out = cluster.tandem("ray", "status")
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(rf"prefill\s+prefill-0\s+serving\s+\S+\s+{ids['p1'][:12]}", out.stdout)
    _generate(cluster.router)


def test_a_lost_decode_node_s_worker_is_restored_on_the_other_decode_node(cluster):
    ids = cluster.node_ids()
    (lost,) = [w for w in _workers(_status(cluster), "decode") if w["node_id"] == ids["d1"]]
    cluster.kill("d1")

    def gone_from_router():
        st = _status(cluster)
        healthy = {r["address"] for r in st["router_workers"] if r["healthy"]}
        return lost["address"] not in healthy and st

    st = _wait_for(gone_from_router, "the router to stop placing on the lost node", 30)
    _generate(cluster.router)  # the remaining decode worker serves

    def restored():
        st = _status(cluster)
        ws = _workers(st, "decode")
        routed = {r["address"] for r in st["router_workers"] if r["healthy"]}
        ok = len(ws) == 2 and all(w["state"] == "serving" for w in ws)
        ok = ok and all(w["node_id"] == ids["d2"] and w["address"] in routed for w in ws)
        return ok and st

    st = _wait_for(restored, f"{lost['name']} restored on d2", 120)
    (moved,) = [w for w in _workers(st, "decode") if w["name"] == lost["name"]]
    assert moved["restarts"] == 1 and moved["pid"] != lost["pid"]
    assert st["pools"]["decode"] == {"target": 2, "serving": 2, "waiting": ""}
    assert lost["address"] not in {r["address"] for r in st["router_workers"]}
    _generate(cluster.router)


def test_a_lost_prefill_node_is_reported_missing_until_it_rejoins(cluster):
    cluster.kill("p1")

    def waiting():
        st = _status(cluster)
        return "no alive node has prefill" in st["pools"]["prefill"]["waiting"] and st

    st = _wait_for(waiting, "the prefill pool waiting for a prefill node", 60)
    assert st["pools"]["prefill"]["serving"] == 0
    out = cluster.tandem("ray", "status")
    assert re.search(r"prefill: 0 of 1 serving; no alive node offers .*'prefill': 1", out.stdout)

    cluster.start_worker("p2", "prefill", slots=2, cpus=1)
    p2 = _wait_for(lambda: cluster.node_ids().get("p2"), "the prefill node back", 60)

    def refilled():
        st = _status(cluster)
        ws = _workers(st, "prefill")
        routed = {r["address"] for r in st["router_workers"] if r["healthy"]}
        ok = [w for w in ws if w["state"] == "serving" and w["address"] in routed]
        return len(ws) == 1 and ok and ok[0]["node_id"] == p2 and st

    st = _wait_for(refilled, "the prefill pool filled on the new node", 120)
    assert st["pools"]["prefill"]["waiting"] == ""
    _generate(cluster.router)


def test_a_killed_controller_adopts_every_worker_and_scales_and_autoscales_again(cluster):
    before = _status(cluster)
    pid = before["controller"]["pid"]
    os.kill(pid, signal.SIGKILL)

    def back():
        try:
            st = _status(cluster)
        except Exception:  # noqa: BLE001 - a call in flight at the kill fails
            return None
        return st["controller"]["pid"] != pid and st

    st = _wait_for(back, "the restarted controller's status", 60, interval_s=0.5)
    assert st["controller"]["actor_id"] == before["controller"]["actor_id"]
    assert any("controller restarted: adopted 3 workers (3 serving)" in e for e in st["events"])

    def same(s: dict) -> dict:
        return {w["name"]: (w["pid"], w["incarnation"], w["address"]) for w in s["workers"]}

    assert same(st) == same(before)  # no worker restarted
    assert st["router_pid"] == before["router_pid"] and st["router"] == before["router"]
    assert st["targets"] == before["targets"] == {"prefill": 1, "decode": 2}
    routed = {(r["pool"], r["address"]) for r in st["router_workers"]}
    assert routed == {(w["pool"], w["address"]) for w in st["workers"]}
    _generate(cluster.router)

    # A manual scale works, then the autoscaler (idle pools) takes prefill back to 1.
    out = cluster.tandem("ray", "scale", "--prefill", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(re.findall(r"prefill\s+prefill-\d+\s+serving", out.stdout)) == 2, out.stdout

    def shrunk():
        st = _status(cluster)
        ok = st["targets"]["prefill"] == 1 and len(_workers(st, "prefill")) == 1
        return ok and any("autoscale prefill: 2 -> 1" in e for e in st["events"]) and st

    st = _wait_for(shrunk, "the autoscaler to shrink prefill", 60)
    assert {n: v for n, v in same(st).items() if n in same(before)} == {
        n: v for n, v in same(before).items() if n in same(st)
    }
    _generate(cluster.router)
