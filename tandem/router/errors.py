"""Failures the router answers with a gRPC status (the message is for the client)."""

from __future__ import annotations

import grpc

from tandem.errors import TandemError


class RouterError(TandemError):
    def __init__(
        self, code: grpc.StatusCode, message: str, reason: str = "", retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # RESOURCE_EXHAUSTED from the router's own limits: which one
        self.retry_after_s = retry_after_s  # RESOURCE_EXHAUSTED: when to try again

    @classmethod
    def overloaded(cls, message: str, reason: str = "", retry_after_s: float = 1.0) -> RouterError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, retry_after_s)

    @classmethod
    def unavailable(cls, message: str) -> RouterError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)
