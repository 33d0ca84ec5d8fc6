"""The autoscaling policy on synthetic metrics: no Ray, no workers."""

from __future__ import annotations

import math

import pytest

from tandem.deploy.autoscale import AutoscaleConfig, Autoscaler, PoolPolicy, wanted_replicas
from tandem.errors import ConfigError


def _config(**kw) -> AutoscaleConfig:
    values = dict(
        enabled=True,
        prefill=PoolPolicy(min_replicas=1, max_replicas=6, target=2.0),
        decode=PoolPolicy(min_replicas=1, max_replicas=4, target=0.5),
        tolerance=0.1,
        scale_up_cooldown_s=30,
        scale_down_cooldown_s=60,
        scale_down_window_s=0,  # its own test below
    )
    values.update(kw)
    return AutoscaleConfig(**values)


def _sizes(decisions) -> tuple[int, int]:
    return decisions["prefill"].replicas, decisions["decode"].replicas


def test_wanted_replicas_follows_mean_load_over_target():
    policy = PoolPolicy(min_replicas=1, max_replicas=10, target=2.0)
    assert wanted_replicas(2, [4, 4], policy, 0.1) == 4  # twice the target: twice the workers
    assert wanted_replicas(2, [6, 0], policy, 0.1) == 3  # mean 3 -> ceil(2 * 1.5)
    assert wanted_replicas(4, [1, 1, 1, 1], policy, 0.1) == 2
    assert wanted_replicas(4, [0, 0, 0, 0], policy, 0.1) == 1  # idle: down to the minimum
    assert wanted_replicas(2, [2.1, 2.1], policy, 0.1) == 2  # within tolerance: unchanged
    assert wanted_replicas(2, [2.3, 2.3], policy, 0.1) == 3  # just outside it


def test_wanted_replicas_is_bounded_and_keeps_the_size_without_numbers():
    policy = PoolPolicy(min_replicas=2, max_replicas=3, target=1.0)
    assert wanted_replicas(2, [100, 100], policy, 0.1) == 3
    assert wanted_replicas(3, [0, 0, 0], policy, 0.1) == 2
    assert wanted_replicas(3, [], policy, 0.1) == 3  # workers still starting: no opinion
    assert wanted_replicas(5, [], policy, 0.1) == 3  # but never outside the bounds
    assert wanted_replicas(1, [], policy, 0.1) == 2


def test_scale_up_on_prefill_queue_depth_and_decode_kv_use():
    scaler = Autoscaler(_config())
    d = scaler.decide(0.0, {"prefill": 1, "decode": 2}, {"prefill": [6], "decode": [0.9, 0.8]})
    assert _sizes(d) == (3, 4)  # queue 6 vs 2 per worker; KV 0.85 vs 0.5 -> ceil(3.4)
    assert "over target" in d["prefill"].reason


def test_scale_down_removes_one_worker_per_decision():
    scaler = Autoscaler(_config(scale_down_cooldown_s=0))
    d = scaler.decide(0.0, {"prefill": 4, "decode": 3}, {"prefill": [0] * 4, "decode": [0.0] * 3})
    assert d["prefill"].wanted == 1 and _sizes(d) == (3, 2)
    d = scaler.decide(1.0, {"prefill": 3, "decode": 2}, {"prefill": [0] * 3, "decode": [0.0] * 2})
    assert _sizes(d) == (2, 1)


def test_cooldowns_hold_the_size_after_a_change():
    scaler = Autoscaler(_config())
    busy = {"prefill": [8], "decode": [0.5]}
    assert _sizes(scaler.decide(0.0, {"prefill": 1, "decode": 1}, busy)) == (4, 1)
    # Still busy 10 s later: the new workers' effect is not in the numbers yet.
    d = scaler.decide(10.0, {"prefill": 4, "decode": 1}, {"prefill": [8] * 4, "decode": [0.5]})
    assert d["prefill"].replicas == 4 and d["prefill"].wanted == 6
    assert "cooling down" in d["prefill"].reason
    # Idle at 40 s: up-cooldown over, but shrinking waits for the longer down-cooldown.
    idle = {"prefill": [0] * 4, "decode": [0.5]}
    assert scaler.decide(40.0, {"prefill": 4, "decode": 1}, idle)["prefill"].replicas == 4
    assert scaler.decide(61.0, {"prefill": 4, "decode": 1}, idle)["prefill"].replicas == 3
    # The decode pool never changed, so it has no cooldown to wait for.
    d = scaler.decide(62.0, {"prefill": 3, "decode": 1}, {"prefill": [2] * 3, "decode": [1.0]})
    assert _sizes(d) == (3, 2)


def test_a_manual_resize_starts_the_cooldown():
    scaler = Autoscaler(_config())
    scaler.resized("decode", 100.0)
    load = {"prefill": [2], "decode": [1.0]}
    assert _sizes(scaler.decide(110.0, {"prefill": 1, "decode": 1}, load)) == (1, 1)
    assert _sizes(scaler.decide(131.0, {"prefill": 1, "decode": 1}, load)) == (1, 2)


def test_bounds_win_over_cooldown_and_load():
    scaler = Autoscaler(_config())
    scaler.resized("prefill", 0.0)
    scaler.resized("decode", 0.0)
    d = scaler.decide(1.0, {"prefill": 9, "decode": 0}, {"prefill": [9] * 9, "decode": []})
    assert _sizes(d) == (6, 1)  # max 6 for prefill, min 1 for decode, at once
    assert "outside" in d["prefill"].reason
    d = scaler.decide(100.0, {"prefill": 6, "decode": 4}, {"prefill": [50] * 6, "decode": [1] * 4})
    assert _sizes(d) == (6, 4)  # at the maximum: no further growth


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"prefill": PoolPolicy(min_replicas=0)}, "prefill.min_replicas must be >= 1"),
        ({"decode": PoolPolicy(min_replicas=3, max_replicas=2)}, "max_replicas must be >= "),
        ({"decode": PoolPolicy(target=1.5)}, "KV utilisation in \\(0, 1\\]"),
        ({"prefill": PoolPolicy(target=0)}, "target must be > 0"),
        ({"interval_s": 0}, "interval_s must be > 0"),
        ({"tolerance": 1.0}, "tolerance must be in"),
    ],
)
def test_bad_settings_are_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        AutoscaleConfig(**kw)


def test_a_pool_shrinks_only_when_its_load_stayed_low_over_the_window():
    # Each decision used one sample: a steady but noisy queue (mean 5 over 3 workers)
    # lost a worker at one low sample and won it back at the next high one, a drain
    # and a model load each time; and a pool shrank 5 s after the autoscaler started.
    scaler = Autoscaler(_config(scale_down_cooldown_s=0, scale_down_window_s=60))
    low, high = {"prefill": [0, 1, 1], "decode": [0.5]}, {"prefill": [2, 2, 2], "decode": [0.5]}
    sizes = {"prefill": 3, "decode": 1}
    assert scaler.decide(5.0, sizes, low)["prefill"].replicas == 3  # just started
    assert "scale_down_window_s" in scaler.decide(6.0, sizes, low)["prefill"].reason
    for t in range(30, 200, 30):  # a low sample between high ones: the size holds
        assert scaler.decide(float(t), sizes, high)["prefill"].replicas == 3
        assert scaler.decide(t + 15.0, sizes, low)["prefill"].replicas == 3
    for t in range(200, 250, 10):  # low from 195 s on: the window still holds 180 s's
        assert scaler.decide(float(t), sizes, low)["prefill"].replicas == 3
    assert scaler.decide(250.0, sizes, low)["prefill"].replicas == 2


@pytest.mark.parametrize("name", ["interval_s", "scale_up_cooldown_s", "scale_down_cooldown_s",
                                  "scale_down_window_s"])  # fmt: skip
def test_a_setting_that_is_not_a_number_or_negative_is_refused_by_name(name):
    # NaN passed "x <= 0": asyncio.sleep(nan) never returns, and a NaN cooldown never cools.
    for bad in (math.nan, -5.0):
        with pytest.raises(ConfigError, match=f"autoscale.{name} must be"):
            AutoscaleConfig(**{name: bad})
