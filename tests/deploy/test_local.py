"""The local launcher's process handling, with stand-in processes (no model loaded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import yaml

from tandem.config import EngineConfig
from tandem.deploy.local import ClusterConfig, LocalCluster, StartError
from tandem.engine.loader import resolve_model
from tandem.errors import ConfigError
from tests.processes import alive, survivors

FAKE = "tests.deploy.fake_process"


class FakeCluster(LocalCluster):
    """Records every process it starts, so a test can check each one by pid after stop()
    (which clears ``processes``)."""

    modules = {"prefill": FAKE, "decode": FAKE, "router": FAKE}

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.started: list[psutil.Process] = []

    def _spawn(self, name, module, config):
        proc = super()._spawn(name, module, config)
        self.started.append(psutil.Process(proc.popen.pid))
        return proc


def _config(**kw) -> ClusterConfig:
    return ClusterConfig(engine=EngineConfig(model="tiny-random"), **kw)


def test_start_passes_worker_addresses_to_the_router_and_stop_ends_everything(tmp_path):
    engine = EngineConfig(model="tiny-random", max_model_len=64)
    config = ClusterConfig(engine=engine, num_prefill=2, num_decode=1, threads_per_worker=1,
                           drain_timeout_s=42)  # fmt: skip
    cluster = FakeCluster(config, tmp_path)
    address = cluster.start()
    procs = list(cluster.processes)
    assert address.startswith("127.0.0.1:") and len(procs) == 4
    router_cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
    workers = {p.name: p.ready["grpc"] for p in procs if p.name != "router"}
    assert router_cfg["prefill_workers"] == [workers["prefill-0"], workers["prefill-1"]]
    assert router_cfg["decode_workers"] == [workers["decode-0"]]
    assert router_cfg["max_model_len"] == 64  # the workers' context: refused at the router
    assert yaml.safe_load((tmp_path / "decode-0.yaml").read_text())["engine"]["num_threads"] == 1
    for name in ("router", "prefill-0", "decode-0"):  # each drains as long as it is given
        assert yaml.safe_load((tmp_path / f"{name}.yaml").read_text())["drain_timeout_s"] == 42
    assert all(alive(p) for p in cluster.started)
    cluster.stop()
    assert all(p.popen.poll() is not None for p in procs)
    log_text = (tmp_path / "prefill-0.log").read_text()
    assert "prefill printed this after READY" in log_text and "READY prefill" not in log_text
    assert not [p for p in cluster.started if alive(p)]


class OrderedCluster(FakeCluster):
    """Records the order of spawns and READY waits."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.events: list[str] = []

    def _spawn(self, name, module, config):
        self.events.append(f"spawn {name}")
        return super()._spawn(name, module, config)

    def _wait_ready(self, proc) -> None:
        super()._wait_ready(proc)
        self.events.append(f"ready {proc.name}")


@pytest.mark.parametrize("cold", [True, False])
def test_on_a_first_start_one_worker_prepares_the_model_for_the_others(tmp_path, cold):
    # Every worker dequantised the same GGUF at once: 4x the CPU and memory on a first
    # start of 2 + 2 workers, for one directory.
    cache = tmp_path / "cache"
    if not cold:
        resolve_model("tiny-random", cache)
    engine = EngineConfig(model="tiny-random", cache_dir=str(cache))
    cluster = OrderedCluster(ClusterConfig(engine=engine, num_prefill=1, num_decode=2), tmp_path)
    cluster.start()
    cluster.stop()
    spawned = ["spawn prefill-0", "spawn decode-0", "spawn decode-1"]
    if cold:  # the fakes build nothing: the cache stays cold, as the check saw it
        spawned.insert(1, "ready prefill-0")
    assert cluster.events[: len(spawned)] == spawned


def test_a_module_in_the_launchers_directory_does_not_take_the_place_of_the_real_one(
    tmp_path, monkeypatch
):
    # "python -m" put the working directory first on the children's path: a queue.py
    # there failed every worker's start, and ran inside processes holding the keys.
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "logging.py").write_text("raise ImportError('the launcher directory's logging')\n")
    monkeypatch.chdir(here)
    cluster = FakeCluster(_config(), tmp_path / "run")
    cluster.start()
    cluster.stop()


def test_a_process_that_dies_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE_DECODE", "crash")
    cluster = FakeCluster(_config(), tmp_path)
    with pytest.raises(StartError, match="decode-0 exited with code 3") as err:
        cluster.start()
    assert "boom: cannot load the model" in str(err.value)
    # What it printed on stdout is in its log too (UCX's reasons were lost there).
    assert "a library's reason, on stdout" in str(err.value)
    assert len(cluster.started) == 2  # prefill-0 started and was stopped; decode-0 crashed
    assert not [p for p in cluster.started if alive(p)]
    assert cluster.processes == []


def test_a_process_that_dies_while_an_earlier_one_loads_fails_the_start_at_once(
    tmp_path, monkeypatch
):
    # Its death was found only once the earlier one was ready, or blamed on the
    # earlier one's start-up timeout (600 s by default) if that one never got ready.
    monkeypatch.setenv("FAKE_MODE_PREFILL", "silent")
    monkeypatch.setenv("FAKE_MODE_DECODE", "crash")
    cluster = FakeCluster(_config(startup_timeout_s=120), tmp_path)
    start = time.monotonic()
    with pytest.raises(StartError, match="decode-0 exited with code 3") as err:
        cluster.start()
    assert time.monotonic() - start < 60
    assert "a library's reason, on stdout" in str(err.value)
    assert not [p for p in cluster.started if alive(p)]


def test_a_silent_process_times_out_and_a_stubborn_one_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE_ROUTER", "silent")
    monkeypatch.setenv("FAKE_MODE_PREFILL", "stubborn")
    cluster = FakeCluster(_config(startup_timeout_s=1.0, drain_timeout_s=0.5), tmp_path)
    with pytest.raises(StartError, match="router was not ready after 1 s"):
        cluster.start()
    assert len(cluster.started) == 3  # the stubborn prefill worker had to be killed
    assert not [p for p in cluster.started if alive(p)]
    assert cluster.processes == []


def test_the_prometheus_targets_file_lists_the_processes_while_they_serve(tmp_path, monkeypatch):
    # Left as it was after a stop, it named dead ports, which Prometheus went on
    # scraping under the old labels (whatever bound them later).
    from tandem.metrics import targets

    monkeypatch.setenv("FAKE_METRICS", "1")
    cluster = FakeCluster(_config(threads_per_worker=1), tmp_path)
    cluster.start()
    path = tmp_path / "prometheus-targets.json"
    assert len(targets.read(path)) == 3
    cluster.stop()
    assert targets.read(path) == []
    # A launcher killed outright leaves its targets; the next start in the same
    # directory, with metrics off, must not leave them to be scraped.
    path.write_text('[{"targets": ["127.0.0.1:1"], "labels": {"process": "router"}}]')
    monkeypatch.delenv("FAKE_METRICS")
    cluster.start()
    assert targets.read(path) == []
    cluster.stop()


def test_threads_default_to_a_share_of_the_cores_this_may_run_on(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the machine's, not this cpuset's
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert _config(num_prefill=1, num_decode=3).worker_threads() == 2
    assert _config(num_prefill=4, num_decode=5).worker_threads() == 1
    # The engine section's num_threads is a default too (it was replaced without a word).
    from tandem.deploy.local import cluster_config

    given = cluster_config({"engine": {"model": "tiny-random", "num_threads": 3}})
    assert given.worker_threads() == 3
    assert _config(threads_per_worker=1).worker_threads() == 1


# A launcher that starts a fake cluster, prints the children's pids and waits to be killed.
_LAUNCHER = """
import sys, threading
from tandem.config import EngineConfig
from tandem.deploy.local import ClusterConfig
from tests.deploy.test_local import FakeCluster
config = ClusterConfig(engine=EngineConfig(model="tiny-random"), num_prefill=2,
                       threads_per_worker=1, drain_timeout_s=60)
cluster = FakeCluster(config, sys.argv[1])
cluster.start()
print(*(p.pid for p in cluster.started), flush=True)
threading.Event().wait()
"""


def test_children_are_gone_within_seconds_after_the_launcher_is_sigkilled(tmp_path):
    # prefill-1 ignores SIGTERM: the lifeline's hard exit must end it too. The last
    # child is stopped (SIGSTOP): it runs no thread until the kernel continues it.
    env = {**os.environ, "FAKE_MODE_PREFILL": "stubborn"}
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = launcher.stdout.readline()
        children = [psutil.Process(int(pid)) for pid in line.split()]
        assert len(children) == 4, line
        assert all(alive(p) for p in children)
        children[-1].suspend()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(60)
        left = survivors(children, within_s=5.0)
        assert not left, f"outlived their launcher: {[p.cmdline() for p in left]}"
    finally:
        launcher.kill()
        launcher.wait()
        for p in children:
            if alive(p):
                p.kill()


def test_a_cluster_started_from_a_thread_outlives_the_thread(tmp_path):
    # PR_SET_PDEATHSIG would kill the children when the thread that forked them exits.
    cluster = FakeCluster(_config(threads_per_worker=1), tmp_path)
    starter = threading.Thread(target=cluster.start)
    starter.start()
    starter.join()
    try:
        assert len(cluster.started) == 3 and cluster.address
        assert not [p for p in cluster.started if not _alive_for(p, seconds=1.0)]
    finally:
        cluster.stop()
    assert not [p for p in cluster.started if alive(p)]


def _alive_for(proc: psutil.Process, seconds: float) -> bool:
    try:
        proc.wait(seconds)
    except psutil.TimeoutExpired:
        return True
    return False


def test_every_process_gets_the_runs_own_credentials_and_they_leave_the_disk_once_read(
    tmp_path,
):
    cluster = FakeCluster(_config(), tmp_path)
    cluster.start()
    try:
        sections = [
            yaml.safe_load((tmp_path / f"{name}.yaml").read_text())["cluster"]
            for name in ("prefill-0", "decode-0", "router")
        ]
        assert sections[0] == sections[1] == sections[2]
        assert sections[0]["ca_file"].startswith(str(tmp_path / "cluster"))
        # Every process has read them: the key and the KV secret are off the disk
        # already, where a launcher killed outright would leave them; dial keeps a copy.
        assert not (tmp_path / "cluster").exists()
        assert cluster._credentials is not None
    finally:
        cluster.stop()


def test_an_operators_own_credentials_are_used_as_they_are_and_kept(tmp_path):
    from tandem.config import ClusterSecurityConfig
    from tandem.security.cluster import ClusterCredentials

    own = ClusterCredentials.create().write(tmp_path / "own")
    cluster = FakeCluster(_config(cluster=own), tmp_path / "run")
    cluster.start()
    cluster.stop()
    router = yaml.safe_load((tmp_path / "run" / "router.yaml").read_text())["cluster"]
    assert router["key_file"] == own.key_file and (tmp_path / "own" / "member-key.pem").exists()
    off = FakeCluster(_config(cluster=ClusterSecurityConfig(insecure=True)), tmp_path / "off")
    off.start()
    off.stop()
    assert yaml.safe_load((tmp_path / "off" / "decode-0.yaml").read_text())["cluster"] == {
        **vars(ClusterSecurityConfig()), "insecure": True
    }  # fmt: skip


def test_a_log_dir_keeps_the_last_runs_logs_and_serves_one_launcher_at_a_time(tmp_path):
    logs = tmp_path / "var" / "tandem"  # made at start
    config = _config(log_dir=str(logs))
    first = FakeCluster(config)
    first.start()
    try:
        assert first.run_dir == logs and not first.owns_run_dir
        assert "fake router starting" in (logs / "router.log").read_text()
        # A second launcher on the same directory would garble the first one's logs,
        # configs and targets file: refused by name, before it starts anything.
        second = FakeCluster(config)
        with pytest.raises(ConfigError, match=rf"{logs} is in use .*pid {os.getpid()}.*log_dir"):
            second.start()
        assert second.started == []
    finally:
        first.stop()
    (logs / "decode-0.log").write_text("the last run's last words\n")
    (logs / "decode-1.log").write_text("a larger run's\n")
    (logs / "notes.log").write_text("the operator's own\n")
    again = FakeCluster(config)  # the directory is free once the first has stopped
    again.start()
    again.stop()
    assert (logs / "decode-0.log.1").read_text() == "the last run's last words\n"
    assert "fake decode starting" in (logs / "decode-0.log").read_text()
    # Not left to read as this run's; and a file that is not a process's log stays.
    assert (logs / "decode-1.log.1").exists() and not (logs / "decode-1.log").exists()
    assert (logs / "notes.log").read_text() == "the operator's own\n"
    assert not any(alive(p) for p in first.started + again.started)


def test_a_log_dir_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    cluster = FakeCluster(_config(log_dir=str(tmp_path / "file" / "logs")))
    with pytest.raises(ConfigError, match=r"cannot use the log directory .*file/logs.*log_dir"):
        cluster.start()
    assert cluster.started == []


def test_a_launcher_refused_a_busy_log_dir_leaves_the_owners_targets_alone(tmp_path, monkeypatch):
    # Its clean-up after the refusal emptied the targets file of the cluster that owns
    # the directory: Prometheus stopped scraping a live cluster.
    from tandem.metrics import targets

    monkeypatch.setenv("FAKE_METRICS", "1")
    config = _config(threads_per_worker=1, log_dir=str(tmp_path / "logs"))
    owner = FakeCluster(config)
    owner.start()
    try:
        before = (tmp_path / "logs" / "prometheus-targets.json").read_bytes()
        assert len(targets.read(tmp_path / "logs" / "prometheus-targets.json")) == 3
        with pytest.raises(ConfigError, match="in use by another launcher"):
            FakeCluster(config).start()
        assert (tmp_path / "logs" / "prometheus-targets.json").read_bytes() == before
    finally:
        owner.stop()


def test_a_log_dir_is_made_owner_only_and_one_every_user_may_write_is_refused(tmp_path):
    made = tmp_path / "made" / "logs"
    cluster = FakeCluster(_config(log_dir=str(made)))
    cluster.start()
    cluster.stop()
    assert made.stat().st_mode & 0o777 == 0o700  # as a temporary run dir is
    # Where every user may write (/tmp), a link planted as a log or the lock file would
    # aim the launcher's writes at another file.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shared / ".lock").symlink_to(victim)
    cluster = FakeCluster(_config(log_dir=str(shared)))
    with pytest.raises(ConfigError, match=r"cannot use the log directory .*every user may write"):
        cluster.start()
    assert victim.read_text() == "precious" and cluster.started == []


def test_a_with_block_removes_its_temporary_run_dir_unless_it_ends_in_an_error(
    tmp_path, monkeypatch
):
    # Every benchmark and demo run left a tandem-run-* directory behind; one that
    # failed should still leave its logs.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with FakeCluster(_config()) as clean:
        assert clean.run_dir.parent == tmp_path and clean.owns_run_dir
    assert not clean.run_dir.exists()
    with pytest.raises(RuntimeError), FakeCluster(_config()) as failed:
        raise RuntimeError("the benchmark failed")
    assert (failed.run_dir / "router.log").exists()
    with FakeCluster(_config(), tmp_path / "given") as given:  # one given is the caller's
        pass
    assert (given.run_dir / "router.log").exists()


def test_a_start_that_fails_before_any_process_leaves_no_empty_run_dir(tmp_path, monkeypatch):
    # A cluster file it could not read failed `tandem serve` with a tandem-run-* dir
    # left behind holding nothing but the lock. One whose processes logged is kept.
    from tandem.config import ClusterSecurityConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    missing = ClusterSecurityConfig(*(str(tmp_path / name) for name in ("ca", "cert", "key", "kv")))
    early = FakeCluster(_config(cluster=missing))
    with pytest.raises(ConfigError, match="cannot read"):
        early.start()
    assert early.started == [] and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("FAKE_MODE_DECODE", "crash")
    late = FakeCluster(_config())
    with pytest.raises(StartError, match=r"decode-0 exited .* last lines of .*decode-0\.log"):
        late.start()
    assert "boom: cannot load the model" in (late.run_dir / "decode-0.log").read_text()
    given = FakeCluster(_config(cluster=missing), tmp_path / "given")  # the caller's: kept
    with pytest.raises(ConfigError, match="cannot read"):
        given.start()
    assert given.run_dir.is_dir()
