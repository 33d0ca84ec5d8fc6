"""Test harness for the workers: real grpc.aio servers on 127.0.0.1, port 0, in-process.

The servers run on an asyncio loop in a background thread; tests talk to them with
the ordinary synchronous gRPC client, as the router would over the network.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.config import DecodeConfig, EngineConfig, PrefillConfig
from tandem.decode_worker import DecodeServer
from tandem.engine.sampling_params import SamplingParams
from tandem.prefill_worker import PrefillServer
from tandem.wire import worker_request

os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

T = TypeVar("T")
TIMEOUT = 30


def engine_config(**overrides) -> EngineConfig:
    values = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64)
    values.update(overrides)
    return EngineConfig(**values)


class BackgroundLoop:
    """An asyncio event loop on its own thread, for servers the test thread talks to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = TIMEOUT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Worker:
    server: PrefillServer | DecodeServer
    channel: grpc.Channel
    stub: Any  # PrefillWorkerStub or DecodeWorkerStub

    def status(self) -> worker_pb2.WorkerStatus:
        return self.stub.Status(worker_pb2.StatusRequest(), timeout=TIMEOUT)

    def used_blocks(self) -> int:
        return self.status().kv_blocks_used

    def check_clean(self) -> None:
        """Every request ended and freed its blocks; the pool is consistent."""
        engine = self.server.engine
        wait_until(lambda: engine.kv.pool.num_used == 0, what=f"{self.server.role} blocks freed")
        wait_until(lambda: not engine.has_unfinished(), what=f"{self.server.role} requests ended")
        self.server.loop.submit(lambda e: e.kv.pool.check_integrity()).result(TIMEOUT)


def start_worker(bg: BackgroundLoop, config: PrefillConfig | DecodeConfig) -> Worker:
    if isinstance(config, PrefillConfig):
        server, stub_cls = PrefillServer(config), worker_pb2_grpc.PrefillWorkerStub
    else:
        server, stub_cls = DecodeServer(config), worker_pb2_grpc.DecodeWorkerStub
    bg.run(server.start(), timeout=120)
    channel = grpc.insecure_channel(server.address)
    return Worker(server, channel, stub_cls(channel))


def stop_worker(bg: BackgroundLoop, worker: Worker) -> None:
    worker.channel.close()
    bg.run(worker.server.stop(grace=1.0))


@dataclass
class Pair:
    prefill: Worker
    decode: Worker

    def check_clean(self) -> None:
        self.prefill.check_clean()
        self.decode.check_clean()


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> float:
    """Poll ``cond``; returns the seconds it took, fails the test past ``timeout``.

    The timeout only guards against a hang: it is generous so that a loaded machine
    does not fail a test whose event merely came late."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def request(
    prompt: list[int],
    params: SamplingParams,
    rid: str = "r1",
    output_ids: list[int] | None = None,
):
    return worker_request(rid, prompt, params, output_ids)


@dataclass
class Result:
    tokens: list[int]
    text: str
    prefill: worker_pb2.PrefillResponse
    chunks: list[worker_pb2.TokenChunk]


def prefill(
    worker, req: worker_pb2.WorkerRequest, dest: worker_pb2.KvDestination, timeout=TIMEOUT
) -> worker_pb2.PrefillResponse:
    """A whole Prefill call: its two responses (first token, KV outcome) merged into one."""
    merged = worker_pb2.PrefillResponse()
    call = worker.stub.Prefill(
        worker_pb2.PrefillRequest(request=req, destination=dest), timeout=timeout
    )
    for response in call:
        merged.MergeFrom(response)
    return merged


def drive(pair: Pair, req: worker_pb2.WorkerRequest) -> Result:
    """One request by hand, as the router does: Decode first, then Prefill to its destination."""
    stream = pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=TIMEOUT)
    first = next(stream)
    assert first.WhichOneof("kind") == "destination"
    pre = prefill(pair.prefill, req, first.destination)
    tokens, text = [pre.first_token_id], pre.text
    if pre.finish_reason:  # the first token ended it: nothing was sent to the decode side
        stream.cancel()
        return Result(tokens, text, pre, [])
    chunks = [r.chunk for r in stream]
    for c in chunks:
        tokens += c.token_ids
        text += c.text
    return Result(tokens, text, pre, chunks)


# ---- fixtures (imported by tests/prefill_worker and tests/decode_worker conftests) -------


@pytest.fixture(scope="module")
def bg():
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def pair(bg):
    """A prefill and a decode worker joined by real UCX, 64 KV blocks each."""
    prefill = start_worker(
        bg, PrefillConfig(engine=engine_config(), kv_ack_timeout_s=10, kv_connect_timeout_s=1)
    )
    decode = start_worker(bg, DecodeConfig(engine=engine_config(), kv_lease_s=10))
    yield Pair(prefill, decode)
    stop_worker(bg, prefill)
    stop_worker(bg, decode)


@pytest.fixture(autouse=True)
def _workers_clean(request):
    """After every test: each worker's pool is consistent and holds no block."""
    yield
    if "pair" in request.fixturenames:
        request.getfixturevalue("pair").check_clean()
