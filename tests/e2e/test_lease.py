"""A decode reservation outlives its lease while its router still waits for the KV."""

from __future__ import annotations

import time

from tandem.client import TandemClient
from tandem.config import DecodeConfig, PrefillConfig, RouterConfig
from tandem.router import Router
from tests.workers import BackgroundLoop, engine_config, start_worker, stop_worker

LEASE_S = 1.0


def test_a_request_queued_on_a_slow_prefill_worker_keeps_its_decode_reservation():
    bg = BackgroundLoop()
    prefill = start_worker(bg, PrefillConfig(engine=engine_config()))
    decode = start_worker(bg, DecodeConfig(engine=engine_config(), kv_lease_s=LEASE_S))
    engine = prefill.server.engine
    real_step = engine.step

    def slow_step():  # a busy prefill worker: the request waits several leases long
        time.sleep(3 * LEASE_S)
        return real_step()

    engine.step = slow_step
    router = Router(
        RouterConfig(
            model="tiny-random", port=0, max_migrations=0,
            prefill_workers=(prefill.server.address,), decode_workers=(decode.server.address,),
        )
    )  # fmt: skip
    bg.run(router.start(), timeout=120)
    try:
        with TandemClient(router.address, timeout=60) as client:
            done = client.complete(prompt="hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4 and done.finish_reason == "length"
        assert decode.server.transfer_metrics.transfers_done == 1
    finally:
        engine.step = real_step
        bg.run(router.stop(grace=0))
        stop_worker(bg, prefill)
        stop_worker(bg, decode)
        bg.close()
