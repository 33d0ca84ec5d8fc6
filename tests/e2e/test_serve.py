"""`tandem serve` as ops run it: a real command, stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import yaml

from tandem.client import TandemClient


def test_serve_prints_the_address_serves_and_stops_every_process_on_sigint(tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "num_prefill": 1, "num_decode": 1, "threads_per_worker": 1,
        "engine": {"model": "tiny-random", "num_blocks": 64},
        "router": {"port": 0, "max_queue": 8},
        "decode": {"kv_lease_s": 10.0},
    }))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # blocks until the cluster is ready
        match = re.fullmatch(r"tandem: serving tiny-random on (127\.0\.0\.1:\d+)\n", line)
        assert match, line + proc.stderr.read() if proc.poll() is not None else line
        with TandemClient(match.group(1), timeout=30) as client:
            done = client.complete(prompt="hello", max_tokens=5, ignore_eos=True)
        assert done.usage.completion_tokens == 5 and done.finish_reason == "length"
        children = _children(proc.pid)
        assert len(children) == 3, children  # router, prefill, decode
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "a worker outlived tandem serve"
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent reaped or will reap it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
