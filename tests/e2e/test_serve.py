"""`tandem serve` as ops run it: a real command, stopped with Ctrl-C, or killed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tandem.client import TandemClient
from tandem.client.errors import TandemClientError
from tandem.metrics.scrape import scrape, total
from tests.processes import survivors


def test_serve_prints_the_address_serves_and_stops_every_process_on_sigint(tmp_path):
    logs = tmp_path / "logs-of-this-run"  # --log-dir wins over the YAML's log_dir
    proc = _serve(_config(tmp_path, port=0), "--metrics", "--log-format", "json",
                  "--log-dir", str(logs))  # fmt: skip
    try:
        address = _serving_address(proc)
        metrics = {}
        for _ in range(3):  # then the targets file's line
            name, url = re.fullmatch(r"tandem: (\S+) metrics on (http://\S+)\n",
                                     proc.stdout.readline()).groups()  # fmt: skip
            metrics[name] = url.removeprefix("http://").removesuffix("/metrics")
        targets = re.fullmatch(r"tandem: Prometheus file_sd targets in (\S+)\n",
                               proc.stdout.readline()).group(1)  # fmt: skip
        assert sorted(metrics) == ["decode-0", "prefill-0", "router"]
        groups = json.loads(open(targets).read())
        assert {g["targets"][0]: g["labels"]["process"] for g in groups} == {
            a: n for n, a in metrics.items()
        }
        with TandemClient(address, timeout=30) as client:
            done = client.complete(prompt="hello", max_tokens=5, ignore_eos=True)
        assert done.usage.completion_tokens == 5 and done.finish_reason == "length"
        router = scrape(metrics["router"])
        assert total(router, "tandem_router_requests_total", code="OK") == 1
        assert total(router, "tandem_router_generation_tokens_total") == 5
        children = psutil.Process(proc.pid).children()
        assert len(children) == 3, children  # router, prefill, decode
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert not survivors(children, within_s=10.0), "a worker outlived tandem serve"
        # --log-format json: every process logged one JSON object per line.
        run_dir = Path(targets).parent
        assert run_dir == logs
        for name in ("router", "prefill-0", "decode-0"):
            lines = (run_dir / f"{name}.log").read_text().splitlines()
            records = [json.loads(line) for line in lines if line.startswith("{")]
            assert records and len(records) >= len(lines) // 2, lines[:5]
            assert {r["process"] for r in records} == {name.split("-")[0]}
            assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    finally:
        _kill(proc)


def test_sigkill_of_serve_ends_every_child_with_streams_in_flight_and_frees_the_port(tmp_path):
    port = _free_port()
    config = _config(tmp_path, port=port, num_blocks=1024)  # room for two whole contexts
    proc = _serve(config)
    children: list[psutil.Process] = []
    try:
        address = _serving_address(proc)
        assert address == f"127.0.0.1:{port}"
        children = psutil.Process(proc.pid).children()
        assert len(children) == 3, children  # router, prefill, decode
        with TandemClient(address, timeout=120) as client:
            room = client.model_info().context_length - len(client.tokenize("hello"))
            streams = [client.generate("hello", max_tokens=room, ignore_eos=True) for _ in range(2)]
            for stream in streams:
                next(stream)  # a first token: the request is in flight on the workers
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
            left = survivors(children, within_s=5.0)
            assert not left, f"outlived tandem serve: {[p.cmdline() for p in left]}"
            for stream in streams:  # ended with an error, not left hanging
                with pytest.raises(TandemClientError):
                    for _ in stream:
                        pass
        again = _serve(config)  # the router's port is free again
        try:
            assert _serving_address(again) == address
            again.send_signal(signal.SIGTERM)
            assert again.wait(60) == 0
        finally:
            _kill(again)
    finally:
        _kill(proc)
        for p in children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


# `tandem serve` with the launcher tests' stand-in processes (no model loaded).
_SERVE_WITH_FAKES = """
import sys
import tandem.deploy.local
from tandem.cli import main
from tests.deploy.test_local import FakeCluster
tandem.deploy.local.LocalCluster.modules = FakeCluster.modules
sys.exit(main(sys.argv[1:]))
"""


def _serve_with_fakes(log_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SERVE_WITH_FAKES, "serve", "--model", "tiny-random", "--port", "0",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_sigterm_while_serve_starts_stops_what_it_started(tmp_path):
    env = {**os.environ, "FAKE_MODE_ROUTER": "silent"}  # start-up never ends by itself
    proc = _serve_with_fakes(tmp_path, env)
    try:
        deadline = time.monotonic() + 60
        while len(children := psutil.Process(proc.pid).children()) < 3:  # the router started
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130, proc.stderr.read()
        assert not survivors(children, within_s=10.0), "a process outlived tandem serve"
    finally:
        _kill(proc)


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_taken_port_fails_serve_before_any_worker_starts(flag):
    # It was found when the router started, after every worker had loaded the model.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-c", _SERVE_WITH_FAKES, "serve", "--model", "tiny-random",
             *(["--port", "0"] if flag != "--port" else []), flag, str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    setting = flag.removeprefix("--").replace("-", "_")
    assert f"cannot listen on 127.0.0.1:{port} (setting {setting})" in run.stderr
    assert "starting" not in run.stderr  # no worker was started


def test_a_hangup_stops_serve_in_order_as_ctrl_c_does(tmp_path):
    # A closed terminal or a lost ssh session: SIGHUP ended the launcher at once (exit
    # 129), its streams cut, and its children went on their lifelines.
    proc = _serve_with_fakes(tmp_path)
    try:
        assert proc.stdout.readline().startswith("tandem: serving tiny-random on ")
        children = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert "stopping: draining in-flight requests" in proc.stderr.read()
        assert not survivors(children, within_s=10.0)
    finally:
        _kill(proc)


def test_serve_reports_a_process_that_dies_and_ends_when_the_router_does(tmp_path):
    proc = _serve_with_fakes(tmp_path)
    try:
        assert proc.stdout.readline().startswith("tandem: serving tiny-random on ")
        by_role = {}
        for child in psutil.Process(proc.pid).children():
            config = child.cmdline()[child.cmdline().index("--config") + 1]
            by_role[Path(config).stem] = child
        by_role["decode-0"].kill()  # a worker: the router moves its requests on
        time.sleep(1.0)
        assert proc.poll() is None, "serve ended with a worker"
        by_role["router"].kill()  # nothing serves the clients any more
        assert proc.wait(30) == 1
        err = proc.stderr.read()
        assert "decode-0 exited with code -9; its log: " in err
        assert "router exited with code -9; its log: " in err
        assert not survivors(list(by_role.values()), within_s=10.0)
    finally:
        _kill(proc)


def _config(tmp_path, port: int, num_blocks: int = 64):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "num_prefill": 1, "num_decode": 1, "threads_per_worker": 1,
        "engine": {"model": "tiny-random", "num_blocks": num_blocks},
        "router": {"port": port, "max_queue": 8},
        "decode": {"kv_lease_s": 10.0},
        "startup_timeout_s": 300,
        "log_dir": str(tmp_path / "logs"),
    }))  # fmt: skip
    return config


def _serve(config, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--config", str(config), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _serving_address(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()  # blocks until the cluster is ready (or serve exits)
    match = re.fullmatch(r"tandem: serving tiny-random on (127\.0\.0\.1:\d+)\n", line)
    assert match, line + proc.stderr.read() if proc.poll() is not None else line
    return match.group(1)


def test_demo_streams_an_answer_runs_a_load_test_and_leaves_nothing_behind(tmp_path):
    # `make demo`'s command, on the tiny model; each run used to leave its run dir.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "demo", "--model", "tiny-random", "--threads", "1",
         "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 output tokens, finish=length" in proc.stderr
    assert re.search(r"requests +16 completed, 0 failed", proc.stdout + proc.stderr)
    assert list(tmp.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
