"""Status is a liveness and load signal that never waits for the engine."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.config import DecodeConfig, PrefillConfig
from tandem.engine.sampling_params import SamplingParams
from tests.workers import BackgroundLoop, engine_config, start_worker, stop_worker, wait_until

STEP_S = 2.0  # far longer than a Status call may take


@pytest.mark.parametrize("config_cls", [PrefillConfig, DecodeConfig])
def test_status_answers_from_a_snapshot_while_a_long_step_runs(config_cls):
    bg = BackgroundLoop()
    worker = start_worker(bg, config_cls(engine=engine_config(block_size=32), kv_backend="inproc"))
    assert worker.status().kv_block_size == 32  # what prefix-aware placement hashes in
    engine = worker.server.engine
    real_step, in_step = engine.step, threading.Event()

    def slow_step():  # an engine busy with one long step (the GIL released, as torch does)
        in_step.set()
        time.sleep(STEP_S)
        return real_step()

    engine.step = slow_step
    try:
        ids = engine.tokenizer.encode("a request that keeps the engine busy")
        params = SamplingParams(max_tokens=2, temperature=0)
        worker.server.loop.submit(lambda e: e.add_request(ids, params, "busy"))
        assert in_step.wait(30)
        took = []
        for _ in range(5):
            start = time.monotonic()
            status = worker.status()
            took.append(time.monotonic() - start)
            # The snapshot from before the step: the request is queued for it.
            assert status.running + status.queue_depth == 1
        # Behind the engine, each call would have waited for the rest of the step.
        assert sum(took) < STEP_S, took
        wait_until(lambda: not engine.has_unfinished(), timeout=30, what="request done")
        wait_until(lambda: worker.status().kv_blocks_used == 0, timeout=30, what="snapshot")
        status = worker.status()
        assert (status.running, status.queue_depth) == (0, 0)
    finally:
        engine.step = real_step
        stop_worker(bg, worker)
        bg.close()


def test_status_reports_the_host_tier(tiny_engine):
    from tandem.engine.kv_cache import bytes_per_block

    per_block = bytes_per_block(tiny_engine.model_config, 16, tiny_engine.dtype)
    config = engine_config(num_blocks=12, host_kv_cache_bytes=64 * per_block)
    bg = BackgroundLoop()
    worker = start_worker(bg, DecodeConfig(engine=config, kv_backend="inproc"))
    engine = worker.server.engine
    try:
        assert worker.status().host_blocks_used == 0
        # Six growing sequences in 12 blocks: some are swapped out and back in.
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [engine.tokenizer.encode(t * 40) for t in "abcdef"]
        worker.server.loop.submit(lambda e: e.generate(prompts, params)).result(60)
        wait_until(lambda: worker.status().host_swaps_in_total > 0, timeout=30, what="snapshot")
        status = worker.status()
        assert status.host_swaps_out_total == status.host_swaps_in_total > 0
        assert status.host_swaps_out_total == engine.stats.preemptions
    finally:
        stop_worker(bg, worker)
        bg.close()


def test_a_windowed_decode_worker_says_how_much_of_a_prompt_its_prefix_cache_keeps():
    window = dict(block_size=4, kv_sink_tokens=4, kv_window_tokens=8, max_num_batched_tokens=8)
    bg = BackgroundLoop()
    decode = start_worker(bg, DecodeConfig(engine=engine_config(**window), kv_backend="inproc"))
    prefill = start_worker(bg, PrefillConfig(engine=engine_config(**window), kv_backend="inproc"))
    try:
        first_slide = decode.server.engine.kv.first_slide_tokens()
        assert decode.status().prefix_cache_max_tokens == first_slide == 16
        assert prefill.status().prefix_cache_max_tokens == 0  # its prompts never slide
    finally:
        stop_worker(bg, decode)
        stop_worker(bg, prefill)
        bg.close()
