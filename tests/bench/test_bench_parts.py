"""Parts of bench/ scripts that their figures rest on, against hand-computed values."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load, unload


@pytest.fixture
def script(request):
    module = load(request.param)
    yield module
    unload(request.param)


@pytest.mark.parametrize("script", ["status_latency"], indirect=True)
def test_status_latency_takes_the_nearest_rank_percentile(script):
    # It took the next rank up: p99 of 100 samples was their largest.
    samples = [i / 1e3 for i in range(100, 0, -1)]  # 1..100 ms, in any order
    assert script._pct(samples, 0.99) == pytest.approx(99)
    assert script._pct(samples, 0.5) == pytest.approx(50)
    assert script._pct(samples[:1], 0.99) == pytest.approx(100)


@pytest.mark.parametrize("script", ["host_tier"], indirect=True)
def test_host_tier_recomputes_as_many_tokens_as_the_blocks_it_divides_by(script):
    # The text ran out at 87 blocks: past that, each block's recompute looked cheaper.
    def encode(text):
        return list(range(7))

    for blocks in (1, 87, 128, 400):
        assert len(script.prompt_of(encode, blocks)) == 16 * blocks
