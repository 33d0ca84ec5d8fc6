"""What the client returns: plain dataclasses, no protobuf."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


# ``messages=`` takes ChatMessage objects or {"role": ..., "content": ...} mappings.
Message = ChatMessage | Mapping[str, str]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution, and the
    ``top`` most likely alternatives as (token_id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed piece: new text and its tokens; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids, with logprobs=N


@dataclass(frozen=True)
class Completion:
    """A whole generation, as ``complete()`` returns it."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    context_length: int  # prompt + max_tokens may not exceed it
    vocab_size: int
