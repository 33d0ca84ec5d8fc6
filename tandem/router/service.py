"""The public ``tandem.v1.Tandem`` service: the gRPC edge of the router.

Generate: (the API key, checked by auth.py's interceptor) → ``Gateway.generate``
(gateway.py: rate, checks, admission, tokenizing, the relay), whose responses are
streamed as they come. Tokenize takes the same path up to its token ids;
GetModelInfo only the key and its rate. An ``InvalidRequestError`` becomes
INVALID_ARGUMENT and a ``RouterError`` its own status. A client cancel or an
expired deadline cancels this handler; the relay's ``finally`` then cancels the
worker calls.

A message that does not parse (a string field that is not UTF-8, which protobuf
refuses, from a client that builds its bytes by hand) is INVALID_ARGUMENT as well
(``ParseInterceptor``), not the UNKNOWN that gRPC answers for a deserializer's
error; and with API keys on, the key is checked first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.errors import RETRY_PUSHBACK_KEY, InvalidRequestError
from tandem.router.auth import current_key
from tandem.router.errors import RouterError
from tandem.router.gateway import Gateway

log = logging.getLogger(__name__)


class TandemService(tandem_pb2_grpc.TandemServicer):
    def __init__(self, gateway: Gateway, stream_stall_timeout_s: float = 60.0) -> None:
        self.gateway = gateway
        self.frontend = gateway.frontend
        self.admission = gateway.admission
        self.stream_stall_timeout_s = stream_stall_timeout_s

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        stream = self.gateway.generate(request, current_key.get(), context.time_remaining())
        # gRPC asks for the next response once the last one is written, which waits
        # while the client's flow-control window is full: a client that stopped reading
        # is let go after stream_stall_timeout_s (its call ends CANCELLED).
        stalled = _Stalled(self.stream_stall_timeout_s, context)
        try:
            async with aclosing(stream):
                async for response in stream:
                    with stalled:
                        yield response
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await _abort(context, exc)

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        try:
            self.gateway.check_rate(current_key.get())
        except RouterError as exc:
            await _abort(context, exc)
        f = self.frontend
        return tandem_pb2.ModelInfo(
            model_id=f.model_id,
            context_length=self.gateway.context_length(),
            vocab_size=f.vocab_size,
        )

    async def Tokenize(self, request, context: grpc.aio.ServicerContext):
        try:
            ids = await self.gateway.tokenize(request, current_key.get())
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await _abort(context, exc)
        return tandem_pb2.TokenizeResponse(token_ids=ids)


async def _abort(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    """Ends the call with ``exc``'s status; an overload says when to retry (in
    ``RETRY_PUSHBACK_KEY``, machine-readable; the message says it to a person)."""
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait_ms = math.ceil(min(exc.retry_after_s, 86400) * 1000)
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(max(wait_ms, 0))),))
    await context.abort(exc.code, exc.message)


class _Stalled:
    """Around a handler's ``yield``: if the response is not taken within ``timeout_s``,
    the handler's task is cancelled (the request's slots and worker calls are let go at
    once) and the call ends CANCELLED, which the client reads after what it was sent."""

    _ending: set[asyncio.Task] = set()  # the status calls on their way (held, not lost)

    def __init__(self, timeout_s: float, context: grpc.aio.ServicerContext) -> None:
        self.timeout_s = timeout_s
        self._context = context
        self._task = asyncio.current_task()
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout_s, self._expire)

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        why = f"the client took no response for {self.timeout_s:g} s (stream_stall_timeout_s)"
        log.info("%s: ending its stream", why)
        self._task.cancel()
        ending = asyncio.ensure_future(self._end(why))
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)

    async def _end(self, why: str) -> None:
        with contextlib.suppress(Exception):  # AbortError once sent; a call already over
            await self._context.abort(grpc.StatusCode.CANCELLED, why)


class _Unparsed:
    """What a request that did not parse is handed on as, to be refused by name."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


_TANDEM_PREFIX = "/tandem.v1.Tandem/"


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """The Tandem service's handlers (all take one request, and stream from async
    generators), whose undecodable requests get INVALID_ARGUMENT. Put it after the
    API key check: a refused key is UNAUTHENTICATED whatever the bytes."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        # Not health or reflection: their handlers are grpc's own (Health.Watch writes
        # with context.write() from a coroutine, which the wrappers below are not).
        if handler is None or not details.method.startswith(_TANDEM_PREFIX):
            return handler
        parse, method = handler.request_deserializer, details.method

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError as exc:
                return _Unparsed(exc)

        async def refuse(request: _Unparsed, context: grpc.aio.ServicerContext) -> None:
            message = f"{method}: the request does not parse: {request.error}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        if handler.response_streaming:

            async def unary_stream(request, context):
                if isinstance(request, _Unparsed):
                    await refuse(request, context)
                async for response in handler.unary_stream(request, context):
                    yield response

            make, behaviour = grpc.unary_stream_rpc_method_handler, unary_stream
        else:

            async def unary_unary(request, context):
                if isinstance(request, _Unparsed):
                    await refuse(request, context)
                return await handler.unary_unary(request, context)

            make, behaviour = grpc.unary_unary_rpc_method_handler, unary_unary
        return make(behaviour, request_deserializer=deserialize,
                    response_serializer=handler.response_serializer)  # fmt: skip
