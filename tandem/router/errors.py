"""Failures the router answers with a gRPC status (the message is for the client)."""

from __future__ import annotations

import grpc

from tandem.errors import TandemError


class RouterError(TandemError):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # RESOURCE_EXHAUSTED from the router's own limits: which one

    @classmethod
    def overloaded(cls, message: str, reason: str = "") -> RouterError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason)

    @classmethod
    def unavailable(cls, message: str) -> RouterError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)
