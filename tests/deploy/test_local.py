"""The local launcher's process handling, with stand-in processes (no model loaded)."""

from __future__ import annotations

import pytest
import yaml

from tandem.config import EngineConfig
from tandem.deploy.local import ClusterConfig, LocalCluster, StartError

FAKE = "tests.deploy.fake_process"


class FakeCluster(LocalCluster):
    modules = {"prefill": FAKE, "decode": FAKE, "router": FAKE}


def _config(**kw) -> ClusterConfig:
    return ClusterConfig(engine=EngineConfig(model="tiny-random"), **kw)


def test_start_passes_worker_addresses_to_the_router_and_stop_ends_everything(tmp_path):
    cluster = FakeCluster(_config(num_prefill=2, num_decode=1, threads_per_worker=1), tmp_path)
    address = cluster.start()
    procs = list(cluster.processes)
    assert address.startswith("127.0.0.1:") and len(procs) == 4
    router_cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
    workers = {p.name: p.ready["grpc"] for p in procs if p.name != "router"}
    assert router_cfg["prefill_workers"] == [workers["prefill-0"], workers["prefill-1"]]
    assert router_cfg["decode_workers"] == [workers["decode-0"]]
    assert yaml.safe_load((tmp_path / "decode-0.yaml").read_text())["engine"]["num_threads"] == 1
    cluster.stop()
    assert all(p.popen.poll() is not None for p in procs)


def test_a_process_that_dies_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE_DECODE", "crash")
    cluster = FakeCluster(_config(), tmp_path)
    with pytest.raises(StartError, match="decode-0 exited with code 3") as err:
        cluster.start()
    assert "boom: cannot load the model" in str(err.value)
    assert cluster.processes == []  # the prefill worker that did start was stopped


def test_a_silent_process_times_out_and_a_stubborn_one_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE_ROUTER", "silent")
    monkeypatch.setenv("FAKE_MODE_PREFILL", "stubborn")
    cluster = FakeCluster(_config(startup_timeout_s=1.0, drain_timeout_s=0.5), tmp_path)
    with pytest.raises(StartError, match="router was not ready after 1 s"):
        cluster.start()
    assert cluster.processes == []


def test_threads_default_to_a_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _config(num_prefill=1, num_decode=3).worker_threads() == 2
    assert _config(num_prefill=4, num_decode=5).worker_threads() == 1
