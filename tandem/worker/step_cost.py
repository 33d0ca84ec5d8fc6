"""What a worker's engine steps cost lately, for the router's conditional rule.

A decode worker that prefills a prompt itself computes it inside one of its steps,
and every stream in its batch waits that step out. How long that stalls them only
the worker can measure, so it reports what its steps cost in ``Status`` (the
router's conditional rule, tandem/router/disaggregation.py, weighs the second; the
first is what the second is measured against, and a figure to watch):

- ``decode_step_seconds``: a step that only decodes (one token per sequence), an
  exponentially weighted mean over recent such steps;
- ``prefill_token_seconds``: what each prompt token adds to a step: a step's time
  less the decode step's, over its prompt tokens, weighted the same way.

A step of ``n`` prompt tokens then takes about ``decode + n * per_token``: linear in
the tokens, which is what a step's matmuls are; attention's share grows with the
context, which the running means follow as it grows. Both are 0 until the worker
has run such a step (a decode worker that never prefilled has no per-token figure:
the router then counts its prefill as free until it has run one), and on a decode
worker a step with prompt tokens is not measured before a decode-only step has been.
"""

from __future__ import annotations

# The weight of the newest step: about the last ten steps count.
WEIGHT = 0.2
MEASURED_FLOOR_S = 1e-9  # the least a measured prompt token costs


class StepCost:
    def __init__(self, decodes: bool = True) -> None:
        """``decodes``: the worker runs decode steps (a prefill worker does not, and
        counts its steps' whole time as its prompt tokens' cost)."""
        # Written by the engine thread, read by Status (float stores are atomic).
        self.decode_step_seconds = 0.0
        self.prefill_token_seconds = 0.0
        self.decodes = decodes

    def observe(self, seconds: float, sequences: int, tokens: int) -> None:
        """A step of ``sequences`` sequences that computed ``tokens`` tokens in all."""
        if sequences <= 0 or seconds <= 0:
            return
        prompt_tokens = tokens - sequences  # each sequence's first token is its decode's
        if prompt_tokens <= 0:
            # On a prefill worker such a step is a one-token prompt (or one whose blocks
            # were all cached): no decode step, and nothing to measure a token by. Taken
            # for a decode step, it was subtracted from every prefill step after it.
            if self.decodes:
                self.decode_step_seconds = _mean(self.decode_step_seconds, seconds)
            return
        if self.decodes and not self.decode_step_seconds:
            # Nothing to tell the prompt's share from the step's own cost yet (a decode
            # worker's first step is a prefill, its start-up costs included): charged
            # to the prompt, that set a figure several times too high, which then kept
            # prompts off the worker and so was never measured again.
            return
        # A step no slower than the mean decode step (noise, a busy machine) says the
        # prompt tokens cost about nothing: a nanosecond each, not 0, which reads "not
        # measured yet".
        extra = seconds - self.decode_step_seconds
        per_token = max(extra / prompt_tokens, MEASURED_FLOOR_S)
        self.prefill_token_seconds = _mean(self.prefill_token_seconds, per_token)


def _mean(old: float, new: float) -> float:
    return new if old == 0 else (1 - WEIGHT) * old + WEIGHT * new
