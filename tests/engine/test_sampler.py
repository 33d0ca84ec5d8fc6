from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.sampler import (
    _TOP_P_SLACK,
    Sampler,
    _apply_repetition_penalty,
    _sampling_probs,
    draw_seed,
    new_seed,
    splitmix64,
)
from tandem.engine.sampling_params import SamplingParams


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n draws for one row: output positions 0..n-1 of one request, as n rows of a batch."""
    seeds = [draw_seed(seed, i) for i in range(n)]
    return Sampler()(logits.expand(n, -1), [params] * n, seeds, [[]] * n)


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# --- greedy ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = _random_logits(8, 1000, seed=1).to(dtype)
    tokens = Sampler()(logits, [SamplingParams(temperature=0)] * 8, [None] * 8, [[]] * 8)
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_and_leaves_the_logits_alone() -> None:
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 2.0  # three tied maxima: the lowest id wins, as argmax's
    logits[1, [49, 12]] = 1.0
    logits[2, [0, 1]] = float("inf")
    before = logits.clone()
    tokens = Sampler()(logits, [SamplingParams(temperature=0)] * 3, [None] * 3, [[]] * 3)
    assert tokens == [3, 12, 0] == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_rows_beside_sampled_and_penalized_rows_keep_their_tokens() -> None:
    logits = _random_logits(4, 300, seed=3)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0),
    ]
    top = logits.argmax(dim=-1).tolist()
    tokens = Sampler()(logits, params, [None, 4, None, None], [[], [], [top[2]], []])
    assert (tokens[0], tokens[3]) == (top[0], top[3])
    penalized = logits[2].clone()
    _apply_repetition_penalty(penalized[None], params[2:3], [[top[2]]])
    assert tokens[2] == penalized.argmax().item()
    assert torch.equal(logits, before)  # the penalty and the filters wrote on a copy


def test_greedy_rows_ignore_their_seed() -> None:
    logits = _random_logits(3, 100, seed=2)
    params = [SamplingParams(temperature=0)] * 3
    assert Sampler()(logits, params, [1, 2, None], [[]] * 3) == logits.argmax(dim=-1).tolist()


def test_a_draw_depends_only_on_its_seed_and_its_logits() -> None:
    # Identical rows with one seed draw one token, wherever they sit in the batch, and
    # a row drawn before them does not shift their draw (the generator is reseeded).
    logits = _random_logits(1, 500, seed=8).expand(4, -1)
    params = [SamplingParams(temperature=1.5)] * 4
    sampler = Sampler()
    first = sampler(logits, params, [9, 5, 7, 5], [[]] * 4)
    assert first[1] == first[3]
    assert sampler(logits[:1], params[:1], [5], [[]]) == [first[1]]
    # ...and the seed matters: 20 seeds give more than one token from a flat distribution.
    assert len({sampler(logits[:1], params[:1], [s], [[]])[0] for s in range(20)}) > 1


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = _random_logits(2, 50, seed=3)
    copy = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, top_k=3), SamplingParams(temperature=0.5)]
    Sampler()(logits, params, [0, 1], [[0, 1, 2], [4]])
    assert torch.equal(logits, copy)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="one params/seed/history per row"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None, None], [[], []])


# --- repetition penalty ---


@settings(max_examples=60, deadline=None)
@given(
    penalty=st.floats(0.1, 5.0),
    history=st.lists(st.integers(0, 39), max_size=30),
    seed=st.integers(0, 2**31),
)
def test_repetition_penalty_matches_hugging_face(
    penalty: float, history: list[int], seed: int
) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _random_logits(1, 40, seed) * 3
    ours = logits.clone()
    _apply_repetition_penalty(ours, [SamplingParams(repetition_penalty=penalty)], [history])
    ids = torch.tensor([history], dtype=torch.long).reshape(1, -1)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(ours, theirs)


def test_repetition_penalty_applies_per_row_and_skips_penalty_one() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(repetition_penalty=1.0),
        SamplingParams(repetition_penalty=0.5),
    ]
    # Duplicates count once; an id past the vocab is ignored, as Hugging Face does.
    histories = [[0, 1, 0, 7], [0, 1], [2]]
    _apply_repetition_penalty(logits, params, histories)
    assert logits.tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 1.0], [2.0, -2.0, 2.0]]


def test_repetition_penalty_changes_the_greedy_pick() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    assert Sampler()(logits, params, [None], [[0]]) == [1]
    assert Sampler()(logits, params, [None], [[2]]) == [0]


# --- filters: exact probabilities ---


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(top_p=0.01), [1.0, 0.0, 0.0, 0.0]),
        (SamplingParams(top_p=1e-9), [1.0, 0.0, 0.0, 0.0]),  # under the rounding slack
        (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(min_p=0.7), [1.0, 0.0, 0.0, 0.0]),
        (SamplingParams(top_k=3, min_p=0.5), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(top_k=4, top_p=1.0, min_p=0.0), [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_filters_on_a_hand_made_distribution(params: SamplingParams, expected: list[float]) -> None:
    probs = _sampling_probs(_logits_from_probs([0.5, 0.3, 0.15, 0.05]), [params])
    torch.testing.assert_close(probs, torch.tensor([expected]), rtol=0, atol=1e-6)
    # Excluded tokens are masked with -inf, so their probability is exactly zero.
    assert [p == 0.0 for p in probs[0].tolist()] == [e == 0.0 for e in expected]


def test_top_p_boundary_does_not_hinge_on_rounding() -> None:
    # In float32 the mass ahead of the third token comes out a few ulps under 0.8; it
    # must still go, since 0.5 + 0.3 already reaches top_p in real numbers.
    logits = _logits_from_probs([0.5, 0.3, 0.1, 0.1])
    probs = logits.softmax(dim=-1)[0]
    mass_before = probs.cumsum(dim=0) - probs  # as the sampler computes it
    assert mass_before[2].item() < 0.8
    probs = _sampling_probs(logits, [SamplingParams(top_p=0.8)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), rtol=0, atol=1e-6)
    assert probs[0].tolist()[2:] == [0.0, 0.0]


def test_top_p_keeps_the_exact_nucleus_at_a_real_vocabulary_size() -> None:
    # A float32 running sum over 49k tokens, with a slack to match, kept or dropped the
    # boundary token wrongly in 5 rows of 100.
    logits = _random_logits(100, 49_152, seed=3) * 3
    kept = (_sampling_probs(logits.clone(), [SamplingParams(top_p=0.9)] * 100) > 0).sum(dim=-1)
    exact = logits.double().softmax(dim=-1).sort(dim=-1, descending=True).values
    before = exact.cumsum(dim=-1) - exact
    # Exact but for tokens whose mass ahead is within the slack under top_p (rounding
    # of the logits' own precision, see _TOP_P_SLACK): either count is right for those.
    most, least = (before < 0.9).sum(dim=-1), (before < 0.9 - _TOP_P_SLACK).sum(dim=-1)
    assert ((least <= kept) & (kept <= most)).all(), (kept - most).nonzero()


def test_top_k_keeps_exactly_k_under_ties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    probs = _sampling_probs(logits, [SamplingParams(top_k=2)])
    assert int((probs > 0).sum()) == 2


def test_temperature_sharpens_the_distribution() -> None:
    logits = _logits_from_probs([0.5, 0.3, 0.2])
    probs = _sampling_probs(logits.clone(), [SamplingParams(temperature=0.5)])
    expected = torch.tensor([[0.25, 0.09, 0.04]]) / 0.38
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


# --- filters: over many draws ---


def test_top_k_never_emits_a_token_outside_the_top_k() -> None:
    logits = _random_logits(1, 200, seed=4)
    top5 = set(logits[0].topk(5).indices.tolist())
    draws = _draws(logits, SamplingParams(top_k=5, temperature=1.5), 2000)
    assert set(draws) == top5


def test_top_p_never_emits_an_excluded_token() -> None:
    logits = _random_logits(1, 200, seed=5) * 3
    probs = logits[0].double().softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token].item()
        if mass >= 0.6:
            break
    draws = _draws(logits, SamplingParams(top_p=0.6), 2000)
    assert set(draws) <= kept
    assert len(kept) > 1 and len(set(draws)) > 1


def test_min_p_never_emits_an_excluded_token() -> None:
    logits = _random_logits(1, 200, seed=6) * 2
    probs = logits[0].softmax(dim=-1)
    kept = set((probs >= 0.1 * probs.max()).nonzero().flatten().tolist())
    draws = _draws(logits, SamplingParams(min_p=0.1), 2000)
    assert set(draws) <= kept
    assert len(kept) > 1 and len(set(draws)) > 1


def test_hand_made_top_p_draws_only_the_nucleus() -> None:
    draws = _draws(_logits_from_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(top_p=0.8), 2000)
    assert set(draws) == {0, 1}


@pytest.mark.parametrize(
    ("probs", "temperature"),
    [([0.1, 0.2, 0.3, 0.4], 1.0), ([0.5, 0.3, 0.2], 0.5)],
)
def test_sampled_frequencies_match_the_distribution(probs: list[float], temperature: float) -> None:
    n = 4000
    draws = Counter(_draws(_logits_from_probs(probs), SamplingParams(temperature=temperature), n))
    scaled = [p ** (1 / temperature) for p in probs]
    expected = [n * s / sum(scaled) for s in scaled]
    chi2 = sum((draws[i] - e) ** 2 / e for i, e in enumerate(expected))
    # 99.9th percentile of chi-square with 3 degrees of freedom is 16.27 (2 dof: 13.82);
    # the seed is fixed, so this is exact, but a wrong distribution lands far above it.
    assert chi2 < 13.8
    assert set(draws) == set(range(len(probs)))


# --- seeds and batch invariance ---


def _sequence(
    seed: int, params: SamplingParams, others: list[SamplingParams], steps: int = 40
) -> list[int]:
    """The first row's draws over several steps, sharing the batch with ``others``."""
    sampler = Sampler()
    out = []
    for step in range(steps):
        logits = _random_logits(1 + len(others), 64, seed=step)
        histories = [list(range(step % 7))] * (1 + len(others))
        seeds = [draw_seed(seed, step)] + [draw_seed(1000 + i, step) for i in range(len(others))]
        out.append(sampler(logits, [params, *others], seeds, histories)[0])
    return out


_OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(top_k=3, repetition_penalty=1.3),
    SamplingParams(top_p=0.5, temperature=0.7),
    SamplingParams(min_p=0.3, temperature=2.0),
]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    ],
)
def test_same_seed_same_draws_whatever_shares_the_batch(params: SamplingParams) -> None:
    alone = _sequence(7, params, [])
    assert _sequence(7, params, []) == alone
    assert _sequence(7, params, _OTHERS) == alone
    assert _sequence(7, params, _OTHERS[::-1]) == alone


def test_different_seeds_give_different_draws() -> None:
    assert _sequence(7, SamplingParams(), []) != _sequence(8, SamplingParams(), [])


def test_new_seed_keeps_a_given_seed_and_draws_a_fresh_one_otherwise() -> None:
    assert new_seed(7) == 7 and new_seed(0) == 0
    assert new_seed(None) != new_seed(None)


def test_splitmix64_matches_the_reference_sequence() -> None:
    # Vigna's splitmix64.c from state 0: each output is splitmix64 of the state before
    # the increment, the state advancing by the golden gamma.
    gamma = 0x9E3779B97F4A7C15
    outputs = [splitmix64(i * gamma % 2**64) for i in range(3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_draw_seeds_are_distinct_in_range_and_wrap_any_int() -> None:
    grid = {draw_seed(seed, pos) for seed in range(64) for pos in range(64)}
    assert len(grid) == 64 * 64
    assert all(0 <= s < 2**64 for s in grid)
    # Seeds are taken modulo 2**64, as torch wraps the negative ones it accepts.
    assert draw_seed(-1, 3) == draw_seed(2**64 - 1, 3)
    assert draw_seed(2**64 + 5, 0) == draw_seed(5, 0)
    Sampler()(torch.zeros(1, 4), [SamplingParams()], [max(grid)], [[]])  # torch accepts it


def test_the_extremes_that_sampling_params_allow_sample_finite_probabilities() -> None:
    # Logits far larger than a model's, at the lowest temperature and the strongest
    # penalties allowed: nothing overflows, so no row can fail its batch's step.
    logits = torch.tensor([[900.0, -900.0, 899.0, 0.0]])
    for penalty in (0.01, 100.0):
        params = SamplingParams(temperature=1e-5, repetition_penalty=penalty, seed=1)
        row = logits.clone()
        _apply_repetition_penalty(row, [params], [[0, 1, 2]])
        probs = _sampling_probs(row, [params])
        assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
        assert Sampler()(logits, [params], [draw_seed(1, 0)], [[0, 1, 2]]) in ([0], [3])
