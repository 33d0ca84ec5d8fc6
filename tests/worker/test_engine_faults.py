"""A worker whose engine cannot go on ends its process: a hung step (the watchdog;
tests/e2e/test_tensor_parallel.py runs a real one) or an error of the device."""

from __future__ import annotations

import torch

from tandem.config import DecodeConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.server import EXIT_DEVICE_FAULT
from tests.workers import BackgroundLoop, engine_config, start_worker, stop_worker, wait_until


def test_a_device_error_in_a_step_ends_the_worker_with_the_error_and_its_traceback():
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
        wait_until(lambda: exits, what="the worker's exit")
        ((code, why, detail),) = exits
        assert code == EXIT_DEVICE_FAULT
        assert why == "a step failed on the device: CUDA error: an illegal memory access was " \
            "encountered"  # fmt: skip
        assert "in faulty_step" in detail and "torch.AcceleratorError" in detail
        wait_until(lambda: not engine.has_unfinished(), what="the request failed")
    finally:
        engine.step = real_step
        stop_worker(bg, worker)
        bg.close()
    assert engine.kv.pool.num_used == 0
