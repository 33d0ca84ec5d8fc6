"""Errors that carry what a user needs to act on them."""

from __future__ import annotations

# gRPC's standard retry pushback (gRFC A6): the trailing metadata of a call the
# router refused for overload says, in integer milliseconds, when to try again.
# gRPC's own retry policy honours it; the client's ``Overloaded.retry_after_s`` reads it.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class TandemError(Exception):
    """Base class for Tandem's own errors."""


class InvalidRequestError(TandemError, ValueError):
    """A request field is out of range. ``field`` names it; the message gives the limit.

    Maps to gRPC INVALID_ARGUMENT at the wire and to exit code 2 in the CLI.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ConfigError(TandemError, ValueError):
    """A configuration or model the engine cannot run; the message names the setting."""


class OutOfBlocksError(TandemError):
    """The KV block pool cannot satisfy an allocation."""
