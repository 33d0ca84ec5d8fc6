"""``tandem serve`` flags: how many workers of which kind, and where prompts are prefilled."""

from __future__ import annotations

import os

import pytest

from tandem.cli import build_parser, serve_config
from tandem.errors import ConfigError


def _config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_colocated_is_decode_workers_that_prefill_with_no_prefill_pool():
    cfg = _config("--colocated", "3")
    assert (cfg.num_prefill, cfg.num_decode) == (0, 3)
    assert cfg.router.disaggregation.mode == "never"


def test_tensor_parallel_workers_serve_colocated_with_threads_per_rank():
    cfg = _config("--colocated", "2", "--tp", "2", "--model", "tiny-random")
    assert cfg.engine.tensor_parallel_size == 2 and cfg.engine.model == "tiny-random"
    assert cfg.worker_threads() == max(1, len(os.sched_getaffinity(0)) // 4)  # 2 workers x 2 ranks
    cfg = _config("--tensor-parallel-size", "2")  # disaggregated: both pools of width 2
    assert (cfg.num_prefill, cfg.num_decode, cfg.engine.tensor_parallel_size) == (1, 1, 2)


def test_each_pool_may_have_its_own_width():
    cfg = _config("--prefill", "2", "--prefill-tp", "2", "--decode-tp", "1", "--tp", "4")
    assert (cfg.width("prefill"), cfg.width("decode")) == (2, 1)
    assert cfg.worker_threads() == max(1, len(os.sched_getaffinity(0)) // 5)  # 2 x 2 + 1 ranks
    assert _config("--tp", "2", "--decode-tp", "1").width("prefill") == 2


def test_the_default_is_one_plus_one_always_disaggregated():
    cfg = _config()
    assert (cfg.num_prefill, cfg.num_decode, cfg.router.disaggregation.mode) == (1, 1, "always")


def test_conditional_flag_keeps_the_yaml_thresholds(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("num_prefill: 2\nrouter:\n  disaggregation:\n    local_max_tokens: 300\n")
    cfg = _config("--config", str(path), "--disaggregation", "conditional")
    assert cfg.num_prefill == 2
    assert (cfg.router.disaggregation.mode, cfg.router.disaggregation.local_max_tokens) == (
        "conditional", 300
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--colocated", "2", "--prefill", "1"], "--colocated N replaces"),
        (["--colocated", "2", "--disaggregation", "always"], "--colocated N replaces"),
        (["--prefill", "0"], "no prefill worker needs router.disaggregation.mode"),
        # the flag to fix it is named, not only the YAML key
        (
            ["--disaggregation", "never"],
            r"sends nothing to the 1 prefill workers: set "
            r"num_prefill \(--prefill\) 0",
        ),
    ],
)
def test_contradictions_are_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--tp", "0"], "argument --tensor-parallel-size/--tp: must be >= 1, got 0"),
        (["serve", "--decode-tp", "0"], "argument --decode-tp: must be >= 1, got 0"),
        (["serve", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["serve", "--prefill", "-1"], "argument --prefill: must be >= 0, got -1"),
        (["serve", "--port", "70000"], "argument --port: must be a port in [0, 65535], got 70000"),
        (
            ["generate", "--colocated", "--kv-window", "0", "hi"],
            "argument --kv-window: must be >= 1",
        ),
        (["ray", "up", "--decode", "0"], "argument --decode: must be >= 1, got 0"),
        # inf made Ray's wait for the drain fail at once: the controller was killed undrained
        (["ray", "down", "--grace", "inf"], "argument --grace: must be a finite number of seconds"),
        (["ray", "down", "--grace", "-1"], "argument --grace: must be a finite number of seconds"),
    ],
)
def test_a_bad_flag_value_is_named_by_its_flag(argv, message, capsys):
    # It was named by the config field it sets, "(in FILE)" of a --config file that
    # did not hold it, or (ray up --prefill -1) by neither.
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_routers_metrics_port_is_checked_where_metrics_listen(tmp_path, monkeypatch):
    # It was probed on router.host: a free port there refused, and one taken on
    # metrics_host passed, to fail only once every worker had loaded.
    import socket

    from tandem import cli

    monkeypatch.setattr("tandem.deploy.local.LocalCluster", None)  # nothing may start
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "c.yaml"
        path.write_text(f"router: {{metrics_port: {port}, metrics_host: 127.0.0.2}}\n")
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.2:{port} \(setting metrics_port\)"):
            cli.cmd_serve(build_parser().parse_args(["serve", "--config", str(path)]))
