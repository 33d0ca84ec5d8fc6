"""``tandem ray down`` without a cluster: what it stops when the deployment does not answer."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.deploy.ray_cluster import launch


def test_down_stops_a_recorded_local_head_whatever_the_shutdown_raised(tmp_path, monkeypatch):
    state_file = tmp_path / "ray-state.json"
    state = {"address": "127.0.0.1:1", "namespace": "tandem", "head_pid": 4242}
    state_file.write_text(json.dumps(state))
    heads = []

    def stuck(*args):
        raise TimeoutError("shutdown did not return")  # as ray's GetTimeoutError is

    monkeypatch.setattr(launch, "stop_deployment", stuck)
    monkeypatch.setattr(launch, "head_processes", lambda s: ["the head"])  # alive
    monkeypatch.setattr(launch, "stop_head", lambda s: heads.append(s["head_pid"]))
    assert launch.down(state_file) == ["local Ray head (pid 4242)"]
    assert heads == [4242] and not state_file.exists()


def test_down_after_the_local_head_died_forgets_the_deployment_at_once(tmp_path, monkeypatch):
    # A reboot or a crash: connecting would retry for many minutes, and `up` refuses
    # while the file records a deployment.
    state_file = tmp_path / "ray-state.json"
    state = {"address": "127.0.0.1:1", "namespace": "tandem", "head_pid": 4242,
             "router": "127.0.0.1:50051"}  # fmt: skip
    state_file.write_text(json.dumps(state))
    cleaned = []

    def unreachable(*args):
        raise AssertionError("no connection to a dead head")

    monkeypatch.setattr(launch, "stop_deployment", unreachable)
    monkeypatch.setattr(launch, "head_processes", lambda s: [])  # gone
    monkeypatch.setattr(launch, "stop_head", lambda s: cleaned.append(s["head_pid"]))
    assert launch.down(state_file) == []
    assert cleaned == [4242] and not state_file.exists()  # its temp dir and token too


def test_an_address_nobody_answers_at_fails_at_once():
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed
    start = time.monotonic()
    with pytest.raises(launch.RayDeployError, match=f"cannot reach the Ray cluster at "
                       f"127.0.0.1:{port}: .* \\(is its head running"):  # fmt: skip
        launch._probe(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 5


def test_down_without_a_local_head_reports_the_error(tmp_path, monkeypatch):
    state_file = tmp_path / "ray-state.json"
    state_file.write_text(json.dumps({"address": "10.0.0.1:6379", "namespace": "tandem"}))

    def stuck(*args):
        raise TimeoutError("shutdown did not return")

    monkeypatch.setattr(launch, "stop_deployment", stuck)
    with pytest.raises(TimeoutError):
        launch.down(state_file)
    assert state_file.exists()  # still recorded: `down` can be run again


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_a_head_that_fails_to_start_reports_rays_own_words(tmp_path, monkeypatch):
    from tandem.deploy.ray_cluster.head import RayDeployError, start_head

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a machine that never ran Ray
    token = tmp_path / "ray-state.token"
    with pytest.raises(RayDeployError, match="cannot be a custom resource") as info:
        start_head(1, {"CPU": 1.0}, token)  # Ray refuses CPU as a custom resource
    assert "exited" in str(info.value)
    assert not token.exists()  # nothing of the failed head is left


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ctrl_c_while_the_head_starts_leaves_no_head_behind(tmp_path, monkeypatch):
    # The head is in a session of its own, and recorded nowhere until it is up: an
    # interrupted `tandem ray up` would leave a whole Ray head running.
    import subprocess

    import psutil

    from tandem.deploy.ray_cluster import head

    started = []
    popen = subprocess.Popen

    def record(*args, **kw):
        started.append(popen(*args, **kw))
        return started[-1]

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(head.subprocess, "Popen", record)
    monkeypatch.setattr(head.time, "sleep", interrupt)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(KeyboardInterrupt):
        head.start_head(1, {}, tmp_path / "ray-state.token")
    (proc,) = started
    assert proc.poll() is not None  # stopped and reaped
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == "zombie"
    assert not (tmp_path / "ray-state.token").exists()


def test_a_local_head_keeps_its_token_beside_the_state_file(tmp_path):
    from tandem.deploy.ray_cluster.head import auth_env, token_path, write_token

    path = token_path(tmp_path / "ray-state.json")
    write_token(path)
    assert path.name == "ray-state.token" and path.stat().st_mode & 0o777 == 0o600
    assert len(path.read_text()) == 64
    state = {"auth_mode": "token", "auth_token_file": str(path)}
    env = auth_env(state, {"RAY_AUTH_TOKEN": "another cluster's", "PATH": "/bin"})
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path), "PATH": "/bin"}
    assert auth_env({"address": "10.0.0.1:6379"}, {"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_up_refuses_an_open_router_before_it_starts_anything(tmp_path, monkeypatch):
    from tandem.deploy.ray_cluster.config import RayDeployConfig
    from tandem.deploy.ray_cluster.head import RayDeployError

    started = []
    monkeypatch.setattr(launch, "start_head", lambda *a: started.append(a))
    with pytest.raises(RayDeployError, match=r"without TLS: .* or pass --insecure"):
        launch.up(RayDeployConfig(), "10.0.0.1:6379", tmp_path / "state.json")
    assert not started and not (tmp_path / "state.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_a_head_up_starts_itself_keeps_an_open_router_on_loopback(tmp_path, monkeypatch):
    # The one-machine trial (`tandem ray up`, no --address) was refused as written.
    from tandem.deploy.ray_cluster.config import RayDeployConfig

    class Started(Exception):
        pass

    routers = []

    def start_head(*args):
        raise Started

    monkeypatch.setattr(launch, "start_head", start_head)
    monkeypatch.setattr(launch, "_check_exposure", routers.append)
    with pytest.raises(Started):
        launch.up(RayDeployConfig(), None, tmp_path / "state.json")
    assert [r.host for r in routers] == ["127.0.0.1"]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_down_removes_the_deployments_placement_groups_left_behind():
    # A start cut short (shutdown, a controller's death) leaves a detached group that
    # would hold its resources for good; another deployment's groups stay.
    import types

    import ray as real

    removed = []
    ids = {name: real.PlacementGroupID.from_random().hex() for name in "abcde"}
    table = {
        ids["a"]: {"name": "tandem-prod-decode-3", "state": "PENDING"},
        ids["b"]: {"name": "tandem-prod-decode-1", "state": "REMOVED"},
        ids["c"]: {"name": "tandem-staging-decode-1", "state": "CREATED"},
        ids["d"]: {"name": "someone-elses", "state": "CREATED"},
        ids["e"]: {"name": "tandem-prod-eu-decode-1", "state": "CREATED"},  # "prod-eu"'s
    }
    fake = types.SimpleNamespace(
        PlacementGroupID=real.PlacementGroupID,
        util=types.SimpleNamespace(
            placement_group_table=lambda: table,
            remove_placement_group=lambda group: removed.append(group.id.hex()),
        ),
    )
    assert launch.remove_placement_groups(fake, "prod") == ["tandem-prod-decode-3"]
    assert removed == [ids["a"]]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_an_up_refused_for_a_deployment_already_running_leaves_it_running(tmp_path, monkeypatch):
    # Its clean-up ran `down` on the namespace, which stopped the running deployment
    # that the refusal was about (another operator's, another state file's).
    import contextlib

    from tandem.config import RouterConfig
    from tandem.deploy.ray_cluster.config import RayDeployConfig
    from tandem.deploy.ray_cluster.head import RayDeployError

    class Running:
        def get_actor(self, name, namespace):
            return object()  # its controller

    monkeypatch.setattr(launch, "connected", lambda state: contextlib.nullcontext(Running()))
    stopped = []
    monkeypatch.setattr(launch, "stop_deployment", lambda *a, **k: stopped.append(a) or ["x"])
    config = RayDeployConfig(router=RouterConfig(host="127.0.0.1"))
    with pytest.raises(RayDeployError, match="a Tandem deployment already runs in namespace"):
        launch.up(config, "10.0.0.1:6379", tmp_path / "state.json")
    assert stopped == [] and not (tmp_path / "state.json").exists()


def test_the_recorded_clusters_address_keeps_its_token_and_head(tmp_path, monkeypatch):
    # --address replaced the recorded state: the token was lost (every call then
    # failed InvalidAuthToken), and `down --address` of the recorded local head
    # stopped the deployment, left the head running and forgot it.
    state_file = tmp_path / "ray-state.json"
    state = {"namespace": "tandem", "address": "127.0.0.1:6379", "auth_mode": "token",
             "auth_token_file": str(tmp_path / "token"), "head_pid": 4242}  # fmt: skip
    state_file.write_text(json.dumps(state))
    assert launch._state(state_file, "127.0.0.1:6379") == state
    assert launch._state(state_file, "10.0.0.9:6379") == {"namespace": "tandem",
                                                         "address": "10.0.0.9:6379"}  # fmt: skip
    heads = []
    monkeypatch.setattr(launch, "head_processes", lambda s: ["the head"])
    monkeypatch.setattr(launch, "stop_head", lambda s: heads.append(s["head_pid"]))
    monkeypatch.setattr(launch, "stop_deployment", lambda s, grace=30.0: ["deployment"])
    assert launch.down(state_file, "10.0.0.9:6379") == ["deployment"]  # another cluster's
    assert heads == [] and state_file.exists()  # this file's head is not that one
    assert launch.down(state_file, "127.0.0.1:6379") == ["deployment",
                                                         "local Ray head (pid 4242)"]  # fmt: skip
    assert heads == [4242] and not state_file.exists()
