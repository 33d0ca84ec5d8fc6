"""Python client for Tandem's public gRPC API (``tandem.v1.Tandem``).

``TandemClient`` (blocking) and ``AsyncTandemClient`` (asyncio) stream a
generation as ``GenerateChunk`` dataclasses (text delta, token ids; the last
also finish_reason and usage), and raise the exceptions of
``tandem.client.errors`` for failed calls. No protobuf type leaves this package.
"""

from tandem.client.aio import AsyncTandemClient
from tandem.client.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    TandemClientError,
    Unavailable,
)
from tandem.client.sync import TandemClient
from tandem.client.types import ChatMessage, Completion, GenerateChunk, ModelInfo, Usage

__all__ = [
    "AsyncTandemClient",
    "Cancelled",
    "ChatMessage",
    "Completion",
    "DeadlineExceeded",
    "GenerateChunk",
    "InvalidRequest",
    "ModelInfo",
    "Overloaded",
    "TandemClient",
    "TandemClientError",
    "Unavailable",
    "Usage",
]
