"""Log-probabilities of the chosen tokens, against Hugging Face's own distribution."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError


def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log-softmax of HF's logits at each output position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(engine, hf_model, params: SamplingParams, prompt: list[int], tol: float) -> list:
    outs = list(engine.stream(prompt, params))
    got = [lp for o in outs for lp in o.logprobs]
    output = [t for o in outs for t in o.token_ids]
    assert [lp.token_id for lp in got] == output
    ref = _hf_logprobs(hf_model, prompt, output)
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=tol), i
        assert len(lp.top) == params.logprobs
        want_ids = ref[i].topk(params.logprobs).indices.tolist()
        assert [t for t, _ in lp.top] == want_ids, i
        for t, value in lp.top:
            assert value == pytest.approx(ref[i, t].item(), abs=tol)
    return got


def test_greedy_logprobs_are_the_maximum_and_equal_hugging_faces(tiny_engine, tiny_hf):
    prompt = tiny_engine.tokenizer.encode("Hello there, how are you")
    got = _check(tiny_engine, tiny_hf, SamplingParams(max_tokens=8, temperature=0,
                                                      ignore_eos=True, logprobs=3),
                 prompt, tol=1e-4)  # fmt: skip
    for lp in got:  # greedy: the chosen token is the most likely one
        assert lp.top[0] == (lp.token_id, lp.logprob)


def test_sampled_logprobs_are_of_the_models_distribution_not_the_filtered_one(tiny_engine,
                                                                              tiny_hf):  # fmt: skip
    prompt = tiny_engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=6, temperature=1.3, top_k=5, seed=3, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    _check(tiny_engine, tiny_hf, params, prompt, tol=1e-4)


@pytest.mark.slow
def test_default_model_logprobs_equal_hugging_faces(smol_engine, smol_hf):
    prompt = smol_engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    _check(smol_engine, smol_hf, SamplingParams(max_tokens=12, temperature=0, logprobs=5),
           prompt, tol=2e-3)  # fmt: skip


def test_no_logprobs_unless_asked_and_the_bound_is_named(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("Hi")
    outs = list(tiny_engine.stream(prompt, SamplingParams(max_tokens=2, temperature=0)))
    assert all(o.logprobs is None for o in outs)
    with pytest.raises(InvalidRequestError, match=r"logprobs must be in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


def test_tied_top_logprobs_are_listed_in_token_order_first_the_greedy_pick():
    # topk listed ties in any order: greedy's token (the lowest id) was not always first.
    from tandem.engine.sampler import Sampler, token_logprobs

    logits = torch.zeros(1, 1000)
    logits[0, [900, 7, 300, 123]] = 5.0
    greedy = Sampler()(logits, [SamplingParams(temperature=0)], [0], [[]])
    (lp,) = token_logprobs(logits, [0], greedy, [4]).values()
    assert [t for t, _ in lp.top] == [7, 123, 300, 900] and lp.top[0][0] == greedy[0]
    # Only two of the four tied ones fit: the lowest ids, and the rows without such a
    # tie take topk's picks, sorted (a full sort of each row doubled a step's time).
    rows = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    rows[0] = logits[0]
    top = token_logprobs(rows, [0, 1, 2], [7, 0, 0], [2, 5, 5])
    assert [t for t, _ in top[0].top] == [7, 123]
    for r in (1, 2):
        want = torch.log_softmax(rows[r], dim=-1).sort(descending=True, stable=True)
        assert [t for t, _ in top[r].top] == want.indices[:5].tolist()
