"""The public ``tandem.v1.Tandem`` service: the gRPC edge of the router.

Generate: (the API key, checked by auth.py's interceptor) → the key's rate →
the checks that need no tokenizer (INVALID_ARGUMENT, no worker contacted) →
admission, per key and for the router (RESOURCE_EXHAUSTED beyond a bound) →
tokenizing off the event loop and the context-length check → ``Relay.generate``,
whose responses are streamed as they come. Tokenize takes the same path up to
its token ids; GetModelInfo only the key and its rate. A ``RouterError`` becomes
the client's status. A client cancel or an expired deadline cancels this
handler; the relay's ``finally`` then cancels the worker calls.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from tandem import logs
from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.errors import InvalidRequestError
from tandem.metrics import RouterMetrics
from tandem.router.admission import Admission
from tandem.router.auth import current_key
from tandem.router.errors import RouterError
from tandem.router.frontend import Frontend
from tandem.router.relay import Relay

log = logging.getLogger(__name__)


class TandemService(tandem_pb2_grpc.TandemServicer):
    def __init__(
        self,
        frontend: Frontend,
        admission: Admission,
        relay: Relay,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.frontend = frontend
        self.admission = admission
        self.relay = relay
        self.metrics = metrics or relay.metrics

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        key = current_key.get()
        request_id = ""
        track = self.metrics.track()
        code, reason = "OK", ""
        try:
            self.admission.check_rate(key)
            checked = self.frontend.check(request)
            request_id = checked.request_id
            logs.request_id.set(request_id)  # this handler's log lines carry it
            with self.admission.admit(key):
                prepared = await self.frontend.prepare(checked)
                stream = self.relay.generate(prepared, context.time_remaining(), track.arrived)
                async with aclosing(stream):
                    async for response in stream:
                        track.response(response)
                        yield response
        except InvalidRequestError as exc:
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            code, reason = exc.code.name, exc.reason
            who = f" (key {key.name})" if key is not None else ""
            log.info("request %s%s failed: %s: %s", request_id or "-", who, exc.code.name,
                     exc.message)  # fmt: skip
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled or timed out
            code = "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            track.end(code, reason)

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        try:
            self.admission.check_rate(current_key.get())
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        f = self.frontend
        return tandem_pb2.ModelInfo(
            model_id=f.model_id, context_length=f.context_length, vocab_size=f.vocab_size
        )

    async def Tokenize(self, request, context: grpc.aio.ServicerContext):
        key = current_key.get()
        try:
            self.admission.check_rate(key)
            text = self.frontend.check_input(request)
            with self.admission.admit(key):
                ids = await self.frontend.encode(text)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        return tandem_pb2.TokenizeResponse(token_ids=ids)
