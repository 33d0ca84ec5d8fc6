"""The public ``tandem.v1.Tandem`` service: the gRPC edge of the router.

Generate: (the API key, checked by auth.py's interceptor) → ``Gateway.generate``
(gateway.py: rate, checks, admission, tokenizing, the relay), whose responses are
streamed as they come. Tokenize takes the same path up to its token ids;
GetModelInfo only the key and its rate. An ``InvalidRequestError`` becomes
INVALID_ARGUMENT and a ``RouterError`` its own status. A client cancel or an
expired deadline cancels this handler; the relay's ``finally`` then cancels the
worker calls.
"""

from __future__ import annotations

import logging
from contextlib import aclosing

import grpc

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.errors import InvalidRequestError
from tandem.router.auth import current_key
from tandem.router.errors import RouterError
from tandem.router.gateway import Gateway

log = logging.getLogger(__name__)


class TandemService(tandem_pb2_grpc.TandemServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.frontend = gateway.frontend
        self.admission = gateway.admission

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        stream = self.gateway.generate(request, current_key.get(), context.time_remaining())
        try:
            async with aclosing(stream):
                async for response in stream:
                    yield response
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await context.abort(exc.code, exc.message)

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
        try:
            ids = await self.gateway.tokenize(request, current_key.get())
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        return tandem_pb2.TokenizeResponse(token_ids=ids)
