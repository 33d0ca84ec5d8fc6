"""``TandemClient``: the blocking client.

    with TandemClient("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)

``timeout`` (seconds) becomes the call's gRPC deadline: when it passes, every
stage of the cluster stops the request. Closing a stream (``close()``, or the end
of a ``with client.generate(...) as stream:`` block) cancels the call, which frees
the request's KV on the workers; so does leaving a loop early over a stream that
nothing else holds (``for chunk in client.generate(...)``), once Python drops it.
A stream kept in a variable runs on after a ``break`` until it is closed, as its
tokens may still be wanted. Failures raise the exceptions of
``tandem.client.errors``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import grpc

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import _convert
from tandem.client._connect import KEEPALIVE_S, Connection
from tandem.client.errors import from_rpc_error
from tandem.client.types import Completion, GenerateChunk, Message, ModelInfo


class TandemClient:
    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        tls: bool | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        api_key: str | None = None,
        keepalive_s: float | None = KEEPALIVE_S,
    ) -> None:
        """``timeout``: the default per-call deadline in seconds (None or inf: none).

        ``tls``: None speaks TLS when any of the files is given; ``ca_file`` verifies
        the router (None: the system's root certificates); ``cert_file`` and
        ``key_file`` are presented to a router that requires client certificates.
        ``api_key`` (None: $TANDEM_API_KEY) is sent with every call; it is refused
        without TLS unless the router is on loopback.

        ``keepalive_s``: while a call is open, the router is pinged this often, and a
        ping unanswered for 20 s fails the call with ``Unavailable`` (a router that
        froze or whose host went away sends nothing); None: no pings.
        """
        self.address = address
        _convert.deadline(timeout)  # a bad one is refused here, not at the first call
        self.timeout = timeout
        connection = Connection.make(
            address, tls_on=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
            api_key=api_key, keepalive_s=keepalive_s,
        )  # fmt: skip
        self._metadata = connection.metadata
        self._channel = connection.sync_channel()
        self._stub = tandem_pb2_grpc.TandemStub(self._channel)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        stop: Iterable[str] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        request_id: str = "",
        timeout: float | None = None,
    ) -> Stream:
        """Streams the generation; the last chunk has ``finish_reason`` and ``usage``."""
        request = _convert.generate_request(
            prompt, messages, request_id,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, repetition_penalty=repetition_penalty, stop=stop,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        return self._stream(request, self._timeout(timeout))

    def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """``generate`` gathered into one ``Completion`` (same arguments)."""
        builder = _convert.CompletionBuilder()
        with self.generate(prompt, **kwargs) as stream:
            for c in stream:
                builder.add(c)
        return builder.build()

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            info = self._stub.GetModelInfo(
                tandem_pb2.GetModelInfoRequest(),
                timeout=self._timeout(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return _convert.model_info(info)

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        request = _convert.tokenize_request(prompt, messages)
        try:
            response = self._stub.Tokenize(
                request, timeout=self._timeout(timeout), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return list(response.token_ids)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return _convert.deadline(self.timeout if timeout is None else timeout)

    def _stream(self, request: tandem_pb2.GenerateRequest, timeout: float | None) -> Stream:
        return Stream(lambda: self._stub.Generate(request, timeout=timeout,
                                                  metadata=self._metadata))  # fmt: skip


class Stream(Iterator[GenerateChunk]):
    """One Generate call's chunks, the call made on the first ``next``: iterate it;
    ``close()`` (or leaving ``with``) cancels the call (a no-op once it has ended) and
    ends the iteration, as a generator's does. Dropped unclosed, it is cancelled when
    Python collects it."""

    def __init__(self, start) -> None:
        self._start = start
        self._call = None
        self._closed = False

    def __next__(self) -> GenerateChunk:
        if self._closed:  # as a closed generator: no more chunks
            raise StopIteration
        if self._call is None:
            self._call = self._start()
        try:
            return _convert.chunk(next(self._call))
        except grpc.RpcError as exc:
            if self._closed:  # closed from another thread while this one waited
                raise StopIteration from None
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit, gRPC may be gone
            self.close()
