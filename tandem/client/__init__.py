"""Python client for Tandem's public gRPC API (``tandem.v1.Tandem``).

``TandemClient`` (blocking) and ``AsyncTandemClient`` (asyncio) stream a
generation as ``GenerateChunk`` dataclasses (text delta, token ids; the last
also finish_reason and usage), and raise the exceptions of
``tandem.client.errors`` for failed calls. No protobuf type leaves this package.
Both connect the same way (``_connect.py``): plaintext, TLS (``ca_file``, or the
system's roots), mutual TLS (``cert_file``, ``key_file``), and an API key sent as
``authorization: Bearer`` metadata (``api_key=`` or $TANDEM_API_KEY). ``flags.py``
holds the command-line flags for the same.
"""

from tandem.client.aio import AsyncTandemClient
from tandem.client.errors import (
    AlreadyInFlight,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    RequestTooLarge,
    TandemClientError,
    Unauthenticated,
    Unavailable,
)
from tandem.client.sync import TandemClient
from tandem.client.types import (
    ChatMessage,
    Completion,
    GenerateChunk,
    ModelInfo,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AlreadyInFlight",
    "AsyncTandemClient",
    "Cancelled",
    "ChatMessage",
    "Completion",
    "DeadlineExceeded",
    "GenerateChunk",
    "InvalidRequest",
    "ModelInfo",
    "Overloaded",
    "RequestTooLarge",
    "TandemClient",
    "TandemClientError",
    "TokenLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
