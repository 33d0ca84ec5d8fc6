"""Per-request sampling settings, validated once at the edge of the system."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from tandem.errors import InvalidRequestError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# Below it (and above 0) logits / temperature overflow float32, and the step that
# samples the request fails with every other request in its batch. vLLM's floor too.
MIN_TEMPERATURE = 1e-5
# The same for a penalty's logit / p and logit * p; far past any value in use (1-2).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable
    those filters; ``seed`` makes each draw depend only on the seed, the position and
    the model's probabilities (which move slightly with how the prompt was computed
    and with what shares its steps, and in bfloat16 enough to change the text:
    README, "How far a seed reproduces").
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of each chosen token (None: off) and of this many most likely
    # alternatives (0: the chosen token's only), from the model's own distribution.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists arrive from YAML, JSON and protobuf; store tuples so the object stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            _bad("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _bad("temperature", f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < _float32(MIN_TEMPERATURE):  # logits / t would overflow
            _bad(
                "temperature",
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                f"got {self.temperature:g}",
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            _bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            _bad("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            _bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            _bad(
                "repetition_penalty",
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}",
            )
        low, high = REPETITION_PENALTY_RANGE  # beyond them logits overflow to inf
        if not _float32(low) <= self.repetition_penalty <= high:
            _bad(
                "repetition_penalty",
                f"repetition_penalty must be in [{low:g}, {high:g}], "
                f"got {self.repetition_penalty:g}",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for i, s in enumerate(self.stop):
            if s == "":
                _bad("stop", f"stop strings must be non-empty, got an empty stop[{i}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _bad(field: str, message: str) -> None:
    raise InvalidRequestError(field, message)


# float32's smallest positive value (a subnormal): a smaller magnitude is 0 in float32.
FLOAT32_TINY = 1.401298464324817e-45


def to_float32(name: str, value: float) -> float:
    """``value`` of the float sampling field ``name`` as its float32 field is to carry it.

    float32 flushes a magnitude under ``FLOAT32_TINY`` to 0, and the checks then
    judged and quoted that 0 rather than the value sent (top_p 1e-50, in (0, 1], was
    refused as "got 0.0"; temperature 1e-50 became 0, greedy). Such a value is checked
    here as sent (InvalidRequestError naming it), and carried as ``FLOAT32_TINY`` of its
    sign where valid, which only top_p and min_p can be: it means what the value did
    (any top_p under the sampler's 1e-7 slack keeps the most likely token alone; a
    min_p that small drops nothing the softmax gives a probability above 0)."""
    if value == 0 or _float32(value) != 0:
        return value
    SamplingParams(**{name: value})
    return math.copysign(FLOAT32_TINY, value)


def _float32(bound: float) -> float:
    """``bound`` as a float32 field carries it (the wire's sampling fields are float32:
    1e-5 arrives as 9.9999997e-06), so that the documented bound itself is accepted."""
    return struct.unpack("f", struct.pack("f", bound))[0]
