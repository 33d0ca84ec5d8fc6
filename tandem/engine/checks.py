"""Request checks that need no engine (and no torch): the router makes them too."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError


def check_request(
    prompt_ids: Seq[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    output_ids: Seq[int] = (),
) -> None:
    """The checks any stage can make without a KV pool (the router makes them too).

    ``output_ids`` (earlier output of a continued request) count towards max_tokens,
    so prompt + max_tokens bounds the context either way.
    """
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("prompt", "prompt must not be empty")
    total = n + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the context length {max_model_len}",
        )
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt", f"token id {bad} is outside [0, {vocab_size})")
    if len(output_ids) >= params.max_tokens:
        raise InvalidRequestError(
            "output_token_ids",
            f"output_token_ids must be fewer than max_tokens ({params.max_tokens}), "
            f"got {len(output_ids)}",
        )
    bad = next((t for t in output_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "output_token_ids", f"output token id {bad} is outside [0, {vocab_size})"
        )
