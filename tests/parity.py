"""Greedy token parity against Hugging Face ``generate``, with an honest near-tie rule.

Two correct float implementations may pick different tokens only where the
reference's two best logits are (nearly) equal. When outputs diverge, this
checks the reference's top-2 gap at the first differing step and that our token
is one of those two; anything else is a bug.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # logit units; float32 reorderings move logits by ~1e-5 on these models


def hf_greedy(hf_model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_parity(hf_model, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    if ours == ref:
        return
    i = next(
        (k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b),
        min(len(ours), len(ref)),
    )
    assert i < len(ours) and i < len(ref), f"lengths differ without a token mismatch at {i}"
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
    top2 = logits.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap < NEAR_TIE and ours[i] in top2.indices.tolist(), (
        f"diverged at output token {i}: ours {ours[i]}, reference {ref[i]}, "
        f"reference top-2 gap {gap:.2e} (near-tie limit {NEAR_TIE})"
    )
