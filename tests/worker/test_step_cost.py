"""A worker's step costs, as it reports them in Status for the conditional rule."""

from __future__ import annotations

import pytest

from tandem.worker.step_cost import MEASURED_FLOOR_S, WEIGHT, StepCost


def test_decode_steps_and_prompt_tokens_are_told_apart():
    cost = StepCost()
    assert (cost.decode_step_seconds, cost.prefill_token_seconds) == (0, 0)
    cost.observe(0.1, sequences=4, tokens=4)  # decodes only
    assert cost.decode_step_seconds == pytest.approx(0.1)
    assert cost.prefill_token_seconds == 0
    # 4 decodes and a 101-token prompt chunk: 0.3 s over the decode step's 0.1.
    cost.observe(0.4, sequences=5, tokens=105)
    assert cost.prefill_token_seconds == pytest.approx(0.3 / 100)
    assert cost.decode_step_seconds == pytest.approx(0.1)  # a mixed step is not a decode


def test_the_figures_follow_the_recent_steps():
    cost = StepCost()
    cost.observe(0.1, 2, 2)
    cost.observe(0.2, 2, 2)
    assert cost.decode_step_seconds == pytest.approx((1 - WEIGHT) * 0.1 + WEIGHT * 0.2)
    for _ in range(60):
        cost.observe(0.2, 2, 2)
    assert cost.decode_step_seconds == pytest.approx(0.2, rel=1e-4)


def test_a_step_faster_than_the_decode_figure_costs_no_negative_time_nor_none():
    # Noise (a busy machine's slow decode steps): not negative, and not 0, which
    # reads "never prefilled".
    cost = StepCost()
    cost.observe(0.5, 1, 1)
    cost.observe(0.2, 1, 65)
    assert cost.prefill_token_seconds == MEASURED_FLOOR_S
    cost.observe(0, 0, 0)  # an empty step changes nothing
    assert cost.decode_step_seconds == 0.5


def test_a_step_just_slower_than_the_decode_figure_is_no_cheaper_than_one_just_faster():
    # No cliff at the decode mean: the step's time over its tokens is the floor.
    below, above = StepCost(), StepCost()
    for cost, seconds in ((below, 0.0099999), (above, 0.0100001)):
        cost.observe(0.01, 1, 1)
        cost.observe(seconds, 1, 65)
    assert above.prefill_token_seconds == pytest.approx(below.prefill_token_seconds, abs=1e-8)


def test_a_prefill_before_any_decode_step_sets_no_figure():
    # A decode worker's first step is a prefill: its whole time (start-up included)
    # was charged to the prompt, a figure several times too high that kept prompts
    # off the worker and so was never measured again.
    cost = StepCost()
    cost.observe(0.040, 1, 8)
    assert cost.prefill_token_seconds == 0
    for _ in range(5):
        cost.observe(0.012, 1, 1)
    cost.observe(0.012 + 7e-3, 1, 8)
    assert cost.prefill_token_seconds == pytest.approx(1e-3)


def test_a_prefill_worker_whose_steps_all_carry_prompts_reports_their_cost():
    cost = StepCost(decodes=False)
    for _ in range(10):
        cost.observe(0.05, 1, 512)
    assert cost.prefill_token_seconds == pytest.approx(0.05 / 511)


def test_a_prefill_workers_one_token_prompt_is_no_decode_step():
    # A one-token prompt (or one whose blocks were all cached) set a decode step figure
    # on a worker that never decodes (tandem top showed its STEP), and that figure was
    # then taken off every prefill step after it: 0.0004 s a token for 0.001.
    cost = StepCost(decodes=False)
    cost.observe(0.006, sequences=1, tokens=1)
    cost.observe(0.010, sequences=1, tokens=11)
    assert cost.decode_step_seconds == 0
    assert cost.prefill_token_seconds == pytest.approx(0.001)
