"""A worker whose engine cannot go on ends its process: a hung step (the watchdog;
tests/e2e/test_tensor_parallel.py runs a real one) or an error of the device."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tandem.worker.server as server_module
from tandem.config import DecodeConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.server import EXIT_DEVICE_FAULT
from tests.workers import BackgroundLoop, engine_config, start_worker, stop_worker, wait_until


@pytest.mark.parametrize("device_works", [False, True], ids=["device-broken", "device-fine"])
def test_a_device_error_ends_the_worker_if_the_device_fails_after_it(monkeypatch, device_works):
    # Most CUDA errors are sticky: the device fails every call after them. One that left
    # it working (a kernel launch that one request's shape made invalid) must not end
    # the worker, or the request would end one worker after another as it migrates.
    monkeypatch.setattr(server_module, "device_works", lambda device: device_works)
    bg = BackgroundLoop()
    worker = start_worker(bg, DecodeConfig(engine=engine_config(), kv_backend="inproc"))
    server, engine = worker.server, worker.server.engine
    exits: list[tuple[int, str, str]] = []
    real_step = engine.step

    def faulty_step():
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    server._exit = lambda *args: exits.append(args)  # here the process stays
    engine.step = faulty_step
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        server.loop.submit(lambda e: e.add_request([5, 6, 7], params, "r")).result(30)
        wait_until(lambda: not engine.has_unfinished(), what="the request failed")
        if device_works:
            assert exits == []
        else:
            ((code, why, detail),) = exits
            assert code == EXIT_DEVICE_FAULT
            assert why == ("a step failed on the device, which fails since: CUDA error: an "
                           "illegal memory access was encountered")  # fmt: skip
            assert "in faulty_step" in detail and "torch.AcceleratorError" in detail
    finally:
        engine.step = real_step
        stop_worker(bg, worker)
        bg.close()
    assert engine.kv.pool.num_used == 0


def test_device_works_on_this_machines_device():
    assert server_module.device_works(torch.device("cpu"))


def test_a_worker_whose_engine_hangs_still_stops_and_takes_its_ranks(monkeypatch):
    monkeypatch.setattr(server_module, "_ENGINE_ANSWER_S", 0.5)
    bg = BackgroundLoop()
    worker = start_worker(bg, DecodeConfig(engine=engine_config(), kv_backend="inproc"))
    server, engine = worker.server, worker.server.engine
    gate, killed = threading.Event(), []
    real_step = engine.step

    def hung_step():  # a collective waiting for a stopped rank, say
        gate.wait(30)
        return real_step()

    class Ranks:  # the other ranks of a tensor-parallel engine
        def kill(self):
            killed.append(True)

        def close(self):
            pass

    engine.step = hung_step
    engine.tensor_parallel = Ranks()
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        server.loop.submit(lambda e: e.add_request([5, 6, 7], params, "r")).result(30)
        started = time.monotonic()
        worker.channel.close()
        bg.run(server.stop(grace=0.2))
        assert time.monotonic() - started < 15  # not the engine's 30 s
        assert killed == [True]
    finally:
        gate.set()
        engine.tensor_parallel = None
        engine.step = real_step
        bg.close()
    wait_until(lambda: not server.loop._thread.is_alive(), what="the engine thread ends")
    engine.abort_all()
