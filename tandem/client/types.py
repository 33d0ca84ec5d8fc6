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
class GenerateChunk:
    """One streamed piece: new text and its tokens; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class Completion:
    """A whole generation, as ``complete()`` returns it."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    context_length: int  # prompt + max_tokens may not exceed it
    vocab_size: int
