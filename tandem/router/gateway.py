"""The one path a generation takes through the router, whatever API it came in by.

    not while the router stops (UNAVAILABLE) → key's rate → the checks that need no
    tokenizer (InvalidRequestError, nothing allocated) → admission, per key and for
    the router (RESOURCE_EXHAUSTED beyond a bound) → tokenizing off the event loop
    and the context-length check → ``Relay.generate``, whose responses are yielded
    as they come

The gRPC service (service.py) and the OpenAI-compatible HTTP API (http/) both
call ``Gateway.generate`` with a ``tandem.v1.GenerateRequest``, so both get the
same validation, limits, placement, metrics and request-id logging; each maps
the errors to its own wire (gRPC status, HTTP status). Closing the generator
(a client that cancels or disconnects) cancels the worker calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from grpc import StatusCode as Code

from tandem import logs
from tandem._proto.tandem.v1 import tandem_pb2
from tandem.errors import InvalidRequestError
from tandem.metrics import RouterMetrics
from tandem.router.admission import Admission
from tandem.router.auth import ApiKey
from tandem.router.errors import RouterError
from tandem.router.frontend import Frontend
from tandem.router.placement import Pool
from tandem.router.relay import Relay

log = logging.getLogger(__name__)


class Gateway:
    def __init__(
        self, frontend: Frontend, admission: Admission, relay: Relay, metrics: RouterMetrics
    ) -> None:
        self.frontend = frontend
        self.admission = admission
        self.relay = relay
        self.metrics = metrics
        self.stopping = False  # the router drains: new requests are refused
        self.overloaded = logs.Throttle(log)  # flushed by the router's stop

    async def generate(
        self,
        request: tandem_pb2.GenerateRequest,
        key: ApiKey | None,
        timeout: float | None,
        rate_taken: bool = False,
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """``timeout``: the client's remaining seconds (None: no deadline);
        ``rate_taken``: the caller has taken this call from the key's rate already.
        Raises InvalidRequestError or RouterError; either way the request is counted."""
        request_id = ""
        track = self.metrics.track()
        code, reason = "OK", ""
        try:
            self._refuse_if_stopping()
            if not rate_taken:
                self.admission.check_rate(key)
            checked = self.frontend.check(request)
            request_id = checked.request_id
            logs.request_id.set(request_id)  # this task's log lines carry it
            with self.admission.admit(key):
                prepared = await self.frontend.prepare(checked, key.tenant if key else "",
                                                       self.sequence_capacity())  # fmt: skip
                stream = self.relay.generate(prepared, timeout, track.arrived)
                async with aclosing(stream):
                    async for response in stream:
                        track.response(response)
                        yield response
        except InvalidRequestError:
            code = "INVALID_ARGUMENT"
            raise
        except RouterError as exc:
            code, reason = exc.code.name, exc.reason
            who = f" (key {key.name})" if key is not None else ""
            # Overload refuses at the rate requests arrive: that line, throttled.
            line = ("request %s%s failed: %s: %s", request_id or "-", who, exc.code.name,
                    exc.message)  # fmt: skip
            if exc.code is Code.RESOURCE_EXHAUSTED:  # a line per key and cause at most
                self.overloaded.log(logging.INFO, *line, kind=(who, reason))
            else:
                log.info(*line)
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled or timed out
            late = timeout is not None and time.monotonic() >= track.arrived + timeout - 0.01
            code = "DEADLINE_EXCEEDED" if late else "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            track.end(code, reason)

    async def tokenize(self, request, key: ApiKey | None, rate_taken: bool = False) -> list[int]:
        """The token ids of a ``GenerateRequest``'s or ``TokenizeRequest``'s input."""
        self._refuse_if_stopping()
        if not rate_taken:
            self.check_rate(key)
        text = self.frontend.check_input(request)
        try:
            with self.admission.admit(key):
                return await self.frontend.encode(text)
        except RouterError as exc:
            self.refused(exc)
            raise

    def sequence_capacity(self) -> int | None:
        """The most tokens a decode worker's KV pool holds for one sequence (the smallest
        pool's, from the workers' last Status; None: none has reported)."""
        return self.relay.registry.sequence_capacity(Pool.DECODE)

    def context_length(self) -> int:
        """The longest prompt + max_tokens this router serves: the model's context, or
        the decode workers' KV pools where they hold less."""
        return min(self.frontend.context_length, self.sequence_capacity() or 2**31)

    def check_rate(self, key: ApiKey | None) -> None:
        """Takes a call from ``key``'s rate outside ``generate`` (model info, tokenize,
        and HTTP's check before it reads a body); a refusal is counted, as
        ``generate`` counts its own."""
        try:
            self.admission.check_rate(key)
        except RouterError as exc:
            self.refused(exc)
            raise

    def refused(self, exc: RouterError) -> None:
        """Counts a refusal by the router's own limits (admission_rejections) of a call
        that ``generate`` does not see."""
        if exc.code is Code.RESOURCE_EXHAUSTED:
            self.metrics.rejected(exc.reason)

    def _refuse_if_stopping(self) -> None:
        if self.stopping:
            raise RouterError.unavailable("the router is stopping; send it to another")
