"""The OpenAI-compatible HTTP API, served by the router process next to gRPC.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/{model}]
    GET /health (no key needed)  GET /metrics (the router's Prometheus metrics; with
    API keys, a key is needed here, not on the router's own ``metrics_port``)

Why this stack: Starlette (the ASGI toolkit FastAPI is built on; small, typed,
maintained by Encode) served by uvicorn **on the router's own event loop**. A
request then goes from the HTTP handler to ``Gateway.generate`` — the same
admission queue, limits, placement and relay as gRPC — and its tokens come back
through the same asyncio streams, with no thread hop or second process in
between; one loop keeps one count of what is in flight. FastAPI's pydantic
models would add a validation layer whose errors are not OpenAI's; the bodies
are checked in protocol.py instead, with OpenAI's error shape.

Each request: API key (``Authorization: Bearer``, the router's keys; /health is
exempt) → body (at most ``max_request_bytes``, as on the gRPC port: 413 beyond,
the rest read and dropped, not kept, for up to ``LINGER_S``) → protocol.parse →
``Gateway.generate``. Nothing is sent
before the first token: errors before it are proper HTTP statuses (400 naming
the field, 401, 404 for another model, 413, 429 with ``Retry-After``, 503, 504),
and a failure after it ends the event stream with an ``error`` event. Whatever
else goes wrong is a 500 in OpenAI's error shape, never a bare text page. A client that
disconnects — mid-stream or while waiting for a whole response — cancels the
request on every worker, as a gRPC cancel does. TLS and client certificates are
the public port's (``tls_cert_file``, ``tls_key_file``, ``tls_client_ca_file``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
import h11
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem import logs
from tandem.config import RouterConfig, host_port
from tandem.errors import ConfigError, InvalidRequestError
from tandem.router.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from tandem.router.errors import RouterError
from tandem.router.gateway import Gateway
from tandem.router.http import protocol
from tandem.router.http.protocol import ApiError, Parsed, Shaper
from tandem.router.public_port import connection_cap

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
         504: "timeout"}  # fmt: skip


class HttpApi:
    """Starlette app + uvicorn server; ``start`` binds, ``stop`` drains."""

    def __init__(
        self, gateway: Gateway, keys: ApiKeys | None, ready, max_request_bytes: int
    ) -> None:
        """``ready()``: whether the router can serve now (for /health)."""
        self.gateway = gateway
        self.max_request_bytes = max_request_bytes
        self.keys = keys
        self.ready = ready
        self.started = int(time.time())
        self.address: str | None = None
        self._server = None
        self._task: asyncio.Task | None = None
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_error, Exception: _internal_error})  # fmt: skip

    # ---- life cycle --------------------------------------------------------------------

    async def start(self, config: RouterConfig) -> str:
        """Bind ``config.host:config.http_port`` (0: a free port) and serve; "host:port"."""
        port = config.http_port
        sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.host, port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot serve HTTP on {config.host}:{port} (setting http_port): "
                              f"{exc}") from exc  # fmt: skip
        tls = None
        if config.tls_cert_file:  # the handshake is _Protocol's, not uvicorn's (below)
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(config.tls_cert_file, config.tls_key_file)
            tls.set_alpn_protocols(["http/1.1"])
            if config.tls_client_ca_file:
                tls.load_verify_locations(config.tls_client_ca_file)
                tls.verify_mode = ssl.CERT_REQUIRED
        protocol = type("_Protocol", (_Protocol,), {
            "stall_timeout_s": config.stream_stall_timeout_s,
            "cap": connection_cap(0.5),  # of the descriptor limit in force now
            "tls": tls,
            "handshakes": set(),
        })  # fmt: skip
        self._protocol = protocol
        server = _Server(uvicorn.Config(
            self.app, lifespan="off", log_level="warning", access_log=False, http=protocol,
        ))  # fmt: skip
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():  # it failed to start: say why
                self._task.result()
                raise ConfigError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.address = host_port(config.host, sock.getsockname()[1])
        log.info("OpenAI-compatible HTTP API on %s://%s/v1", "https" if tls else "http",
                 self.address)  # fmt: skip
        return self.address

    async def stop(self, grace: float) -> None:
        """No new connections; open ones get ``grace`` seconds, then are closed."""
        if self._server is None:
            return
        # Handshakes under way carry no request yet: ended now, and none served from here
        # (uvicorn tells the connections it has to finish, once, as its stop begins).
        self._protocol.stopping = True
        for handshake in list(self._protocol.handshakes):
            handshake.cancel()
        self._server.config.timeout_graceful_shutdown = max(grace, 0.001)
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = self._task = None

    # ---- routes ------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _models(self, request: Request) -> Response:
        try:
            self.gateway.check_rate(self._key(request))  # as gRPC's GetModelInfo
        except (ApiError, RouterError) as exc:
            return _error(_api_error(exc, None))
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, else 404."""
        try:
            self.gateway.check_rate(self._key(request))
            protocol.served_model(request.path_params["model"], self.gateway.frontend.model_id)
        except (ApiError, RouterError) as exc:
            return _error(_api_error(exc, None))
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        f = self.gateway.frontend
        return {
            "id": f.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "tandem",
            "max_model_len": self.gateway.context_length(),
        }  # vLLM's extension: the context length

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: a prompt's or chat's token ids as generation sees them."""
        parsed: Parsed | None = None
        try:
            key = self._key(request)
            self.gateway.check_rate(key)  # before the body is read and parsed
            frontend = self.gateway.frontend

            def tokenize_request(body: Any) -> Parsed:
                chat = isinstance(body, dict) and "messages" in body
                return protocol.parse({**body, "max_tokens": 1} if chat else body, chat,
                                      frontend.model_id, frontend.limits)  # fmt: skip

            parsed = await _json(await self._body(request), tokenize_request)
            ids = await self.gateway.tokenize(parsed.request, key, rate_taken=True)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except (ApiError, InvalidRequestError, RouterError) as exc:
            return _error(_api_error(exc, parsed))
        return JSONResponse({"count": len(ids), "max_model_len":
                             self.gateway.context_length(), "tokens": ids})  # fmt: skip

    async def _health(self, request: Request) -> Response:
        ok = self.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    async def _metrics(self, request: Request) -> Response:
        # The public port: with keys, only callers with one see the workers' addresses
        # and the traffic (Prometheus without a key scrapes the router's metrics_port).
        try:
            self._key(request)
        except ApiError as exc:
            return _error(exc)
        registry = self.gateway.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused (413) past ``max_request_bytes`` without keeping
        more of it than that.

        A client still sending when the 413 goes out would have the connection reset
        under it, and a reset can throw the unread 413 away (urllib lost it every
        time): so the rest is read and dropped for a while first (``LINGER_S``
        seconds at most), as a web server's lingering close does. A client that waits
        for ``100 Continue`` has sent nothing yet."""
        limit = self.max_request_bytes
        length = request.headers.get("content-length", "")
        error = _too_large(int(length), limit) if length.isdigit() and int(length) > limit else None
        if error is not None and request.headers.get("expect", "").lower() == "100-continue":
            raise error
        chunks, size = [], 0
        try:
            async with asyncio.timeout(None) as linger:
                if error is not None:
                    linger.reschedule(asyncio.get_running_loop().time() + LINGER_S)
                async for chunk in request.stream():
                    size += len(chunk)
                    if error is None and size > limit:
                        error = _too_large(size, limit, more=True)
                        linger.reschedule(asyncio.get_running_loop().time() + LINGER_S)
                    if error is None:
                        chunks.append(chunk)
        except (ClientDisconnect, TimeoutError):  # it hung up (or was too slow) mid-upload
            if error is None:
                raise _ClientGone() from None
        if error is not None:
            raise error
        return b"".join(chunks)

    def _key(self, request: Request):
        if self.keys is None:
            return None
        header = request.headers.get("authorization", "")
        key = self.keys.identify([("authorization", header)])
        if key is None:
            raise ApiError(401, UNAUTHENTICATED_MESSAGE, None, "authentication_error",
                           "invalid_api_key")  # fmt: skip
        return key

    async def _generate(self, request: Request, chat: bool) -> Response:
        parsed: Parsed | None = None
        counted = False  # by the gateway, from its first step on
        try:
            key = self._key(request)
            # A call over its key's rate costs nothing more: not its body's read and
            # parse (up to max_request_bytes), which a flood of them made the router's.
            self.gateway.check_rate(key)
            frontend = self.gateway.frontend
            parsed = await _json(
                await self._body(request),
                lambda body: protocol.parse(body, chat, frontend.model_id, frontend.limits),
            )
            logs.request_id.set(parsed.request.request_id)  # before any task copies the context
            responses = self.gateway.generate(parsed.request, key, None, rate_taken=True)
            counted = True
            try:  # errors before the first token: a status
                first = await _unless_gone(request, anext(responses))
            except BaseException:
                await responses.aclose()
                raise
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except (ApiError, InvalidRequestError, RouterError) as exc:
            error = _api_error(exc, parsed)
            if not counted:  # refused before the gateway, which counts what it refuses
                metrics = self.gateway.metrics
                if isinstance(exc, RouterError):  # the key's rate (a rejection counted)
                    metrics.ended(exc.code.name, "none")
                elif error.status in _REFUSED:
                    metrics.ended(_REFUSED[error.status], "none")
            return _error(error)
        frontend = self.gateway.frontend
        shaper = Shaper(parsed, frontend.model_id, frontend.tokenizer)
        if parsed.stream:
            return StreamingResponse(
                _events(first, responses, shaper, parsed.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text, last, logprobs = await _unless_gone(request, _collect(first, responses))
        except _ClientGone:
            return Response(status_code=499)
        except (InvalidRequestError, RouterError) as exc:
            return _error(_api_error(exc, parsed))
        return JSONResponse(shaper.complete(text, last.finish_reason, last.usage, logprobs))


# A request (headers and body) must arrive within this long of the connection's start,
# or of the last response on it; else the connection is closed. uvicorn starts its
# keep-alive timer only after a response, so a connection that sent nothing or half a
# request was held for good, each taking a descriptor from the whole router.
REQUEST_TIMEOUT_S = 30.0
# How long a client has for its TLS handshake (asyncio's default, 60 s, outlasted the
# request timeout above).
HANDSHAKE_TIMEOUT_S = 10.0
# How long the rest of a refused body is read and dropped before its 413 (``_body``).
LINGER_S = 2.0


# The client's states once its whole request is in (MUST_CLOSE: a request that asked
# for Connection: close, or came over HTTP/1.0).
_REQUEST_IN = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, bounded: a connection past the cap is closed at once,
    and one whose request has not all arrived ``REQUEST_TIMEOUT_S`` after it began
    waiting for it is closed (a request arriving slowly: 408's place, with no reply).

    Over TLS the handshake is done here, on the accepted socket (``loop.start_tls``),
    rather than by the server: asyncio calls a server's protocol only once the
    handshake is done, and gives it 60 s, so sockets that never sent a ClientHello
    were held past the cap and past the request timeout, until the process ran out of
    descriptors (the gRPC port's too). Here a socket counts from its accept, and its
    handshake has ``HANDSHAKE_TIMEOUT_S``."""

    cap = 64  # connections held at once: half the descriptors (public_port.py), at start
    stall_timeout_s = 60.0  # RouterConfig.stream_stall_timeout_s, set at start
    tls: ssl.SSLContext | None = None  # the port's TLS, set at start (None: plaintext)
    handshakes: set[asyncio.Task] = set()  # TLS handshakes under way (a set per server)
    stopping = False  # the server stops: a handshake that ends now is not served
    _refused, _told_at = 0, 0.0  # connections closed at the cap, and when last logged
    _stall: asyncio.TimerHandle | None = None
    _deadline: asyncio.TimerHandle | None = None
    # What TLS passed up with the end of the handshake, before connection_made (a
    # client's request often comes in the same read as its Finished).
    _early: list[bytes] | None = None

    def connection_made(self, transport) -> None:
        if self.stopping or len(self.connections) + len(self.handshakes) >= self.cap:
            transport.close()
            cls, now = type(self), time.monotonic()
            cls._refused += 1
            if now - cls._told_at >= 10:  # a flood must not flood the log as well
                log.warning("HTTP: %d connections open, the most held; closed %d new ones",
                            self.cap, cls._refused)  # fmt: skip
                cls._refused, cls._told_at = 0, now
            return
        if self.tls is not None and transport.get_extra_info("sslcontext") is None:
            transport.pause_reading()  # nothing reaches h11 before the handshake is done
            task = self.loop.create_task(self._handshake(transport))
            self.handshakes.add(task)
            task.add_done_callback(self.handshakes.discard)
            return
        super().connection_made(transport)
        self._await_request()
        early, self._early = self._early, None
        for data in early or ():
            self.data_received(data)

    async def _handshake(self, transport) -> None:
        try:
            tls_transport = await self.loop.start_tls(
                transport, self, self.tls, server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 (a bad client: a timeout, a reset, a refused certificate)
            transport.abort()
            return
        except asyncio.CancelledError:  # the server is stopping
            transport.abort()
            raise
        self.handshakes.discard(asyncio.current_task())  # it is a connection from here
        if self.stopping or tls_transport.is_closing():
            tls_transport.abort()
            return
        self.connection_made(tls_transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # TLS's first read, before connection_made (above)
            self._early = [*(self._early or ()), data]
            return
        super().data_received(data)

    def _await_request(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(REQUEST_TIMEOUT_S, self._too_slow)

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state not in _REQUEST_IN and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._deadline is not None and self.conn.their_state in _REQUEST_IN:
            self._deadline.cancel()  # the whole request is in: the answer takes its time
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The answer's tail may wait here for a client that stopped reading, under the
        # high-water mark, so that pause_writing never armed the stall timer; the
        # keep-alive close() then waited for it for good, holding the connection.
        left = self.transport.get_write_buffer_size()
        if self._stall is None and left:
            self._watch_tail(left)
        if not self.transport.is_closing():
            self._await_request()  # the next request on this connection

    def _watch_tail(self, left: int) -> None:
        """Drops the connection unless some of the ``left`` bytes still to send go out
        within ``stall_timeout_s`` (and so on until none is left)."""

        def check() -> None:
            self._stall = None
            now = self.transport.get_write_buffer_size()
            if now and now >= left:
                self._stalled()
            elif now:
                self._watch_tail(now)

        self._stall = self.loop.call_later(self.stall_timeout_s, check)

    def pause_writing(self) -> None:
        """The client is not taking what is sent (the socket's buffer is full): if it
        takes nothing more for ``stall_timeout_s``, the connection is dropped, and the
        stream on it ends as on a disconnect (it held its place in max_queue)."""
        super().pause_writing()
        if self._stall is not None:  # an earlier answer's tail, watched (above)
            self._stall.cancel()
        self._stall = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        log.info("HTTP: the client took nothing for %g s (stream_stall_timeout_s): "
                 "closing its connection", self.stall_timeout_s)  # fmt: skip
        self.transport.abort()  # close() would wait to send what it will not take

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self.transport is not None:  # else refused at the cap: h11 never saw it
            super().connection_lost(exc)


class _Server(uvicorn.Server):
    """uvicorn's Server without its signal handling: the router process owns SIGTERM
    and SIGINT (it drains gRPC and HTTP together)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _collect(first, responses) -> tuple[str, object, list]:
    parts, last, logprobs = [first.text], first, list(first.logprobs)
    async with aclosing(responses):
        async for response in responses:
            parts.append(response.text)
            logprobs.extend(response.logprobs)
            last = response
    return "".join(parts), last, logprobs


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_gone(request: Request, awaitable):
    """``awaitable``'s result; if the client disconnects first, it is cancelled (and so
    are the request's worker calls) and _ClientGone is raised."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler is cancelled (the server stops)
        work.cancel()
        raise
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise _ClientGone
    return work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(first, responses, shaper: Shaper, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; Starlette cancels this (and so the request) on a disconnect."""
    async with aclosing(responses):
        if shaper.chat:
            yield _sse(shaper.chunk("", role=True))
        response = first
        while True:
            chunk = shaper.chunk(response.text, response.finish_reason,
                                 logprobs=response.logprobs)  # fmt: skip
            if chunk is not None:
                yield _sse(chunk)
            if response.finish_reason:
                if include_usage:
                    yield _sse(shaper.usage_chunk(response.usage))
                break
            try:
                response = await anext(responses)
            except StopAsyncIteration:
                break
            except (InvalidRequestError, RouterError) as exc:
                yield _sse(_api_error(exc, None).body())
                break
    yield "data: [DONE]\n\n"


# Requests refused before they reach the gateway (a body that is not JSON, a field of
# the wrong type, another model): counted under the status gRPC's would get.
_REFUSED = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND"}

# A body past this is parsed and checked on a thread: a few MiB of small JSON values
# took the event loop, which every stream (gRPC's too) shares, for a second or two.
# (json.loads holds the GIL, so tens of ms of it still stall the loop; the check of
# every string, most of the cost, no longer does.)
_PARSE_INLINE_BYTES = 64 * 1024


async def _json(raw: bytes, then: Callable[[Any], T] = lambda body: body) -> T:
    """``then(body)`` of the parsed body, on the same thread as the parse when the body
    is large (a chat body of 100,000 tiny messages took 0.2 s to map into a request)."""
    if len(raw) > _PARSE_INLINE_BYTES:
        return await asyncio.to_thread(lambda: then(_parse(raw)))
    return then(_parse(raw))


def _parse(raw: bytes):
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise protocol.bad(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise protocol.bad(None, "the request body nests too deeply") from None
    protocol.check_text(body)
    return body


def _too_large(size: int, limit: int, more: bool = False) -> ApiError:
    return ApiError(413, f"the request body is {size}{' or more' if more else ''} bytes, "
                         f"over the limit of {limit} (max_request_bytes)",
                    None, code="request_too_large")  # fmt: skip


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such path, a method it does not take) in OpenAI's
    error shape."""
    status = exc.status_code
    return _error(ApiError(status, f"{request.method} {request.url.path}: {exc.detail}", None,
                           _TYPE.get(status, "invalid_request_error")), exc.headers)  # fmt: skip


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A failure of ours, in OpenAI's error shape (Starlette logs the traceback)."""
    return _error(ApiError(500, f"internal error: {type(exc).__name__}", None, "server_error"))


# Line breaks to str.splitlines() (and httpx's aiter_lines) that JSON leaves unescaped in
# a string: escaped, so that a client splitting lines that way reads whole events.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def _api_error(exc: Exception, parsed: Parsed | None) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = protocol.param_of(exc.field, parsed)
        message = str(exc).replace("chat.messages", "messages")
        if parsed is not None and parsed.max_tokens_param != "max_tokens":
            message = message.replace("max_tokens", parsed.max_tokens_param)
        return ApiError(400, message, param)
    status = _STATUS.get(exc.code, 500)
    return ApiError(status, exc.message, None, _TYPE.get(status, "server_error"),
                    exc.code.name.lower(), exc.retry_after_s)  # fmt: skip


def _error(exc: ApiError, headers: dict[str, str] | None = None) -> Response:
    if exc.status == 429:
        # Whole seconds (RFC 9110), rounded up: a client that waits that long gets in.
        # At most a day: a key's rate can be set so low that the wait overflows to inf.
        wait = max(1, math.ceil(min(exc.retry_after_s, 86400)))
        headers = {**(headers or {}), "Retry-After": str(wait)}
    return JSONResponse(exc.body(), exc.status, headers=headers)
