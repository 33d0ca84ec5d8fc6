"""The Prometheus targets file: written atomically and safely, read strictly."""

from __future__ import annotations

import json
import os
import stat
import types

import pytest

from tandem.deploy.ray_cluster.status import write_targets
from tandem.metrics import targets, top
from tandem.metrics.scrape import ScrapeError

GROUPS = [targets.group("127.0.0.1:9400", "router", "router")]


def test_a_link_planted_at_the_old_temporary_name_is_not_written_through(tmp_path):
    # The file was written through "<name>.tmp": in a shared /tmp another user could
    # plant that name as a link, and the controller overwrote the file it points to.
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    path = tmp_path / "targets.json"
    os.symlink(victim, tmp_path / "targets.json.tmp")
    targets.write(path, GROUPS)
    assert victim.read_text() == "mine\n"
    assert targets.read(path) == [("127.0.0.1:9400", "router")]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # Prometheus may be another user
    assert sorted(p.name for p in tmp_path.iterdir()) == ["targets.json", "targets.json.tmp",
                                                          "victim"]  # fmt: skip


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path):
    (tmp_path / "targets.json").mkdir()  # a directory in the way: replace fails
    with pytest.raises(OSError):
        targets.write(tmp_path / "targets.json", GROUPS)
    assert [p.name for p in tmp_path.iterdir()] == ["targets.json"]


@pytest.mark.parametrize(
    "content",
    [{"targets": ["h:1"]}, [{"targets": "127.0.0.1:9400"}], ["h:1"],
     [{"targets": ["h:1"], "labels": "router"}], [{"targets": [1]}]],
)  # fmt: skip
def test_a_file_of_another_shape_is_a_clear_error_for_top(tmp_path, content):
    # A JSON object ended `tandem top --file` in an AttributeError; a string of targets
    # was scraped letter by letter (http://1/metrics, http://2/metrics, ...).
    path = tmp_path / "targets.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ScrapeError, match=r"cannot read targets file .*: not a list of file_sd"):
        top.ClusterView(targets_file=path).poll(now=1.0)


def test_a_controller_that_cannot_write_the_file_says_so_once_in_its_events(tmp_path):
    path = tmp_path / "targets.json"
    path.mkdir()  # taken: as another user's file in a shared /tmp would be
    events: list[str] = []
    ctrl = types.SimpleNamespace(
        config=types.SimpleNamespace(targets_file=str(path)), targets_written=None,
        targets_error="", _event=events.append,
    )  # fmt: skip
    for _ in range(3):
        write_targets(ctrl, stopped=True)
    assert len(events) == 1 and f"cannot write the metrics targets file {path}" in events[0]
    assert "set ray.metrics_targets_file" in events[0] and ctrl.targets_written is None
    path.rmdir()
    write_targets(ctrl, stopped=True)
    assert ctrl.targets_written == [] and ctrl.targets_error == "" and path.exists()
