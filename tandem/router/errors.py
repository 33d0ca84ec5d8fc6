"""Failures the router answers with a gRPC status (the message is for the client)."""

from __future__ import annotations

import grpc

from tandem.errors import TandemError


class RouterError(TandemError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def overloaded(cls, message: str) -> RouterError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    @classmethod
    def unavailable(cls, message: str) -> RouterError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)
