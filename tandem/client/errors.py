"""What a failed call raises: one exception class per gRPC status a caller acts on.

- ``InvalidRequest``   (INVALID_ARGUMENT) fix the request; the message names the field
  and the limit, e.g. "max_tokens must be >= 1, got 0";
- ``Unauthenticated``  (UNAUTHENTICATED) no API key, or one the router does not know;
- ``Overloaded``       (RESOURCE_EXHAUSTED) retry later, with backoff (the router's
  bound, or the API key's own: its streams or its rate); ``retry_after_s`` is the
  router's hint of when (gRPC's ``grpc-retry-pushback-ms`` trailer), None without one;
- ``RequestTooLarge``  (RESOURCE_EXHAUSTED from gRPC itself, and an ``InvalidRequest``)
  the message is over the router's ``max_request_bytes``, or the metadata over
  gRPC's limit: it never fits, so it is not ``Overloaded`` (not to be retried);
- ``AlreadyInFlight``  (ALREADY_EXISTS) a request with this request_id is in flight
  under the same API key: pick another id (a UUID), or send it again once that one
  has ended;
- ``Unavailable``      (UNAVAILABLE) no worker of a pool can serve, or one died mid-request,
  or the router is stopping;
- ``DeadlineExceeded`` (DEADLINE_EXCEEDED) the timeout passed; every stage stopped;
- ``Cancelled``        (CANCELLED) the call was cancelled, or the router ended it because
  its responses went untaken for ``stream_stall_timeout_s``;
- ``TandemClientError`` anything else (``code`` says which).
"""

from __future__ import annotations

import grpc

from tandem.errors import RETRY_PUSHBACK_KEY, TandemError


class TandemClientError(TandemError):
    """A failed call; ``code`` is the gRPC status, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class InvalidRequest(TandemClientError, ValueError):
    pass


class Unauthenticated(TandemClientError):
    pass


class Overloaded(TandemClientError):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(code, details)
        self.retry_after_s = retry_after_s  # the router's hint; None: back off on your own


class RequestTooLarge(InvalidRequest):
    pass


class AlreadyInFlight(TandemClientError):
    pass


class Unavailable(TandemClientError):
    pass


class DeadlineExceeded(TandemClientError, TimeoutError):
    pass


class Cancelled(TandemClientError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[TandemClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyInFlight,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


# What gRPC's own size refusals say (its receive bound on a message, its hard limit
# on metadata): the request can never fit.
_TOO_LARGE = ("larger than max", "metadata size exceeds")


def from_rpc_error(exc: grpc.RpcError) -> TandemClientError:
    """The exception for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    cls = _BY_CODE.get(code, TandemClientError)
    if cls is Overloaded:
        if any(t in details for t in _TOO_LARGE):
            return RequestTooLarge(code, details)
        return Overloaded(code, details, _pushback_s(exc))
    return cls(code, details)


def _pushback_s(exc: grpc.RpcError) -> float | None:
    """The call's retry pushback in seconds; None when it has none, or one that
    is not a count of milliseconds (which gRFC A6 reads as "do not retry")."""
    try:
        trailers = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # an error raised before the call had trailers
        return None
    for key, value in trailers:
        if key == RETRY_PUSHBACK_KEY:
            return int(value) / 1000 if str(value).isdigit() else None
    return None
