"""``tandem ray down`` without a cluster: what it stops when the deployment does not answer."""

from __future__ import annotations

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
    monkeypatch.setattr(launch, "stop_head", lambda s: heads.append(s["head_pid"]))
    assert launch.down(state_file) == ["local Ray head (pid 4242)"]
    assert heads == [4242] and not state_file.exists()


def test_down_without_a_local_head_reports_the_error(tmp_path, monkeypatch):
    state_file = tmp_path / "ray-state.json"
    state_file.write_text(json.dumps({"address": "10.0.0.1:6379", "namespace": "tandem"}))

    def stuck(*args):
        raise TimeoutError("shutdown did not return")

    monkeypatch.setattr(launch, "stop_deployment", stuck)
    with pytest.raises(TimeoutError):
        launch.down(state_file)
    assert state_file.exists()  # still recorded: `down` can be run again
