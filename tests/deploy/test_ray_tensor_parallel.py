"""A Ray deployment of a tensor-parallel decode worker (tiny-random, 2 ranks) fed by a
prefill worker of one rank: the pools' widths differ, the decode worker re-splits
the heads it reads.

The worker actor is rank 0 and its other rank is its child process: the
deployment serves one device's tokens, and a killed rank takes the actor down
with it, so Ray restarts the worker with all its ranks, and the router uses it
again.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import psutil
import pytest

from tandem.engine.sampling_params import SamplingParams
from tests.deploy.test_ray_cluster import Deployment, _wait_for, deployment
from tests.processes import survivors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]

CONFIG = """\
engine: {model: tiny-random, num_blocks: 128, dtype: float32, device: cpu}
router: {port: 0}
ray:
  prefill: {replicas: 1, num_cpus: 0.5}
  decode: {num_cpus: 0.5, tensor_parallel_size: 2}
  router: {num_cpus: 0.5}
  monitor_interval_s: 0.5
"""


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    with deployment(Deployment(tmp_path_factory.mktemp("ray-tp"), CONFIG)) as d:
        yield d


def _rank(pid: int) -> psutil.Process:
    (rank,) = psutil.Process(pid).children()
    assert "tandem.engine.parallel" in " ".join(rank.cmdline())
    return rank


def test_a_tensor_parallel_worker_serves_one_devices_tokens_and_restarts_whole(dep, tiny_engine):
    tok = tiny_engine.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = tiny_engine.generate([tok.encode("Hi")], params)  # a raw prompt, no template
    assert dep.generate("Hi", max_tokens=12, temperature=0, ignore_eos=True) == ("length", *want)

    (w,) = dep.workers("decode")
    assert w["resources"].get("CPU") == 1.0  # 0.5 a rank, two ranks
    actor, rank = psutil.Process(w["pid"]), _rank(w["pid"])
    os.kill(rank.pid, signal.SIGKILL)

    def restarted():
        (now,) = dep.workers("decode")
        # (the new process's pid arrives when it announces itself, after the count)
        ok = now["restarts"] == 1 and now["state"] == "serving" and now["pid"] != w["pid"]
        return ok and now

    now = _wait_for(restarted, "the worker's restart with its ranks", timeout_s=120)
    assert survivors([actor, rank], within_s=15) == []
    assert _rank(now["pid"]).pid != rank.pid
    assert dep.generate("Hi", max_tokens=12, temperature=0, ignore_eos=True) == ("length", *want)
