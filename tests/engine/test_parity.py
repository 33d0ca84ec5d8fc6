"""Greedy output equals Hugging Face ``generate`` on the same weights, singly and batched."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tests.parity import assert_parity, hf_greedy

GREEDY = SamplingParams(max_tokens=32, temperature=0)

MESSAGES = [
    "What is the capital of France? Answer in one sentence.",
    "用三句话介绍一下长城。",
    "Summarise the following notes.\n"
    + " ".join(
        f"Note {i}: the shipment of part {i * 7} arrived on day {i % 30}." for i in range(50)
    ),
]


def _prompts(engine) -> list[list[int]]:
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    assert len(prompts[-1]) > 600, "the long prompt must span many KV blocks"
    return prompts


def _check(engine, hf, prompts, outputs, max_new):
    for prompt, ours in zip(prompts, outputs, strict=True):
        ref = hf_greedy(hf, prompt, max_new, engine.eos_token_ids)
        assert_parity(hf, prompt, ours, ref)


def test_tiny_random_single_and_batched(tiny_engine, tiny_hf):
    prompts = _prompts(tiny_engine)
    singles = [tiny_engine.generate([p], GREEDY)[0] for p in prompts]
    _check(tiny_engine, tiny_hf, prompts, singles, GREEDY.max_tokens)
    batched = tiny_engine.generate(prompts, GREEDY)
    assert batched == singles


@pytest.mark.slow
def test_default_model_single(smol_engine, smol_hf):
    prompts = _prompts(smol_engine)
    outs = [smol_engine.generate([p], GREEDY)[0] for p in prompts]
    _check(smol_engine, smol_hf, prompts, outs, GREEDY.max_tokens)
    assert "Paris" in smol_engine.tokenizer.decode(outs[0])


@pytest.mark.slow
def test_default_model_mixed_batch(smol_engine, smol_hf):
    prompts = _prompts(smol_engine)
    # Different output lengths, so the batch shrinks while others still decode.
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (8, 32, 20)]
    outs = smol_engine.generate(prompts, params)
    for prompt, ours, sp in zip(prompts, outs, params, strict=True):
        ref = hf_greedy(smol_hf, prompt, sp.max_tokens, smol_engine.eos_token_ids)
        assert_parity(smol_hf, prompt, ours, ref)
