"""``AsyncTandemClient``: the asyncio client, the same calls as ``TandemClient``.

    async with AsyncTandemClient("127.0.0.1:50051") as client:
        async for chunk in client.generate(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

Cancelling the task that iterates cancels the call, and with it the request on
every worker; so does closing the stream (``await stream.aclose()``, or the end of
an ``async with client.generate(...) as stream:`` block), and leaving a loop early
over a stream that nothing else holds. A stream kept in a variable runs on after
a ``break`` until it is closed. Closing the client ends its calls with
``Cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence

import grpc

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import _convert
from tandem.client._connect import KEEPALIVE_S, Connection
from tandem.client.errors import Cancelled, from_rpc_error
from tandem.client.types import Completion, GenerateChunk, Message, ModelInfo


class AsyncTandemClient:
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
        """``timeout``: the default per-call deadline in seconds (None or inf: none);
        TLS, the API key and ``keepalive_s`` as for ``TandemClient``."""
        self.address = address
        _convert.deadline(timeout)  # a bad one is refused here, not at the first call
        self.timeout = timeout
        connection = Connection.make(
            address, tls_on=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file,
            api_key=api_key, keepalive_s=keepalive_s,
        )  # fmt: skip
        self._metadata = connection.metadata
        self._connection = connection
        # Made on first use, in the event loop that uses it: a gRPC aio channel belongs to
        # the loop it was made in, and a client is often made before any loop runs (at
        # import, then used under asyncio.run, once or several times).
        self._aio_channel: grpc.aio.Channel | None = None
        self._aio_stub: tandem_pb2_grpc.TandemStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def _stub(self) -> tandem_pb2_grpc.TandemStub:
        if self._closed:
            raise ValueError("this client is closed")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the loop it was made in has ended, or another runs
            self._aio_channel = self._connection.aio_channel()
            self._aio_stub = tandem_pb2_grpc.TandemStub(self._aio_channel)
            self._loop = loop
        return self._aio_stub

    @property
    def _channel(self) -> grpc.aio.Channel:
        """The channel for the running event loop (the tests call raw methods on it)."""
        self._stub  # noqa: B018 (made on first use in each loop)
        return self._aio_channel

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
    ) -> AsyncStream:
        """Streams the generation; the last chunk has ``finish_reason`` and ``usage``."""
        request = _convert.generate_request(
            prompt, messages, request_id,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, repetition_penalty=repetition_penalty, stop=stop,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        return self._stream(request, self._timeout(timeout))

    async def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """``generate`` gathered into one ``Completion`` (same arguments)."""
        builder = _convert.CompletionBuilder()
        async with self.generate(prompt, **kwargs) as stream:
            async for c in stream:
                builder.add(c)
        return builder.build()

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        call = self._stub.GetModelInfo(
            tandem_pb2.GetModelInfoRequest(), timeout=self._timeout(timeout),
            metadata=self._metadata,
        )  # fmt: skip
        return _convert.model_info(await _answer(call))

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        request = _convert.tokenize_request(prompt, messages)
        call = self._stub.Tokenize(request, timeout=self._timeout(timeout),
                                   metadata=self._metadata)  # fmt: skip
        return list((await _answer(call)).token_ids)

    async def close(self) -> None:
        self._closed = True
        if self._aio_channel is not None and self._loop is asyncio.get_running_loop():
            await self._aio_channel.close()
        self._aio_channel = self._aio_stub = self._loop = None

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return _convert.deadline(self.timeout if timeout is None else timeout)

    def _stream(self, request: tandem_pb2.GenerateRequest, timeout: float | None) -> AsyncStream:
        return AsyncStream(lambda: self._stub.Generate(request, timeout=timeout,
                                                   metadata=self._metadata))  # fmt: skip


async def _answer(call, answer=None):
    """A call's answer (``answer``: what to await of it, the call itself unless given: a
    stream's ``read()``), or its failure as ``tandem.client.errors``; a call that the
    client's ``close()`` cancelled under a task nobody cancelled is ``Cancelled``
    (gRPC ends it with asyncio's CancelledError, which would pass for the caller's
    own cancellation)."""
    try:
        return await (call if answer is None else answer)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None
    except asyncio.CancelledError:
        if call.cancelled() and not asyncio.current_task().cancelling():
            raise Cancelled(grpc.StatusCode.CANCELLED, "the client was closed") from None
        raise


class AsyncStream:
    """One Generate call's chunks. Leaving the loop early (``break``, an exception)
    cancels the call at once, as the iterator is dropped: an async generator's clean-up
    waited for the event loop to get to it, and a retry under the same request_id sent
    meanwhile found the first still in flight. A stream that is still held is
    cancelled by ``aclose()`` or at the end of ``async with``."""

    def __init__(self, start) -> None:
        self._start = start  # the call, made on first use (in the loop that iterates)
        self._call = None
        self._closed = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._closed:  # as a closed generator: no more chunks (none sent if not begun)
            raise StopAsyncIteration
        if self._call is None:
            self._call = self._start()
        try:
            response = await _answer(self._call, self._call.read())
        except Cancelled:
            if self._closed:  # closed by another task while this one waited
                raise StopAsyncIteration from None
            raise
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return _convert.chunk(response)

    async def aclose(self) -> None:
        self._cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self._cancel()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit, its event loop may be gone
            self._cancel()

    def _cancel(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()  # a no-op once the call has ended
