"""A scripted ``tandem.v1.Tandem`` server (sync gRPC, threads) for client tests."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from tandem import keepalive
from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc


class FakeTandem(tandem_pb2_grpc.TandemServicer):
    """Streams "Hel" [1, 2] then "lo" [3] (stop, usage 4 + 3), unless told to fail or hang."""

    def __init__(self) -> None:
        self.requests: list = []
        self.metadata: list[dict[str, str]] = []  # each call's invocation metadata
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.abort_generate: tuple[grpc.StatusCode, str] | None = None  # Generate only
        self.trailers: tuple[tuple[str, str], ...] = ()  # sent with an abort
        self.hang = False
        self.hang_unary = False  # Tokenize answers only once the call has ended
        self.finish_reason = tandem_pb2.FINISH_REASON_STOP
        self.final = True  # False: the stream ends (OK) without its final response
        self.time_remaining: float | None = None
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_remaining = context.time_remaining()
        if self.abort is not None or self.abort_generate is not None:
            context.set_trailing_metadata(self.trailers)
            context.abort(*(self.abort or self.abort_generate))
        if self.hang:  # only a cancel or the deadline ends the call; the callback sees it end
            context.add_callback(self.cancelled.set)
        yield tandem_pb2.GenerateResponse(request_id="r1", text="Hel", token_ids=[1, 2])
        if self.hang:
            while context.is_active():
                time.sleep(0.01)
            return
        if not self.final:
            return
        yield tandem_pb2.GenerateResponse(
            request_id="r1",
            text="lo",
            token_ids=[3],
            finish_reason=self.finish_reason,
            usage=tandem_pb2.Usage(prompt_tokens=4, completion_tokens=3),
        )

    def GetModelInfo(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return tandem_pb2.ModelInfo(model_id="m", context_length=2048, vocab_size=100)

    def Tokenize(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.abort is not None:
            context.set_trailing_metadata(self.trailers)
            context.abort(*self.abort)
        while self.hang_unary and context.is_active():
            time.sleep(0.01)
        return tandem_pb2.TokenizeResponse(token_ids=[5, 6])


class FakeServer:
    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = FakeTandem()
        # As the router's: pings (the clients' keepalive) accepted at any rate.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=keepalive.SERVER_OPTIONS)  # fmt: skip
        tandem_pb2_grpc.add_TandemServicer_to_server(self.servicer, self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


if __name__ == "__main__":  # a server in its own process, which a test can freeze
    server = FakeServer()
    server.servicer.hang = True
    print(server.address, flush=True)
    server.server.wait_for_termination()
