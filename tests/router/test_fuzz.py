"""Generated requests over a real channel: every answer is OK, INVALID_ARGUMENT or
RESOURCE_EXHAUSTED, never INTERNAL or UNKNOWN, and the router stays SERVING.

The router runs with the scripted workers of fakes.py (real gRPC end to end, no
model) and small limits, so that both sides of each limit are reached cheaply.
Hypothesis draws every field: prompt or chat (or neither), roles, sampling values
(extreme, NaN, infinite, negative), many and long stop strings, unicode, request
ids, and messages over the gRPC size bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tests.router.fakes import cluster

LIMITS = dict(max_prompt_chars=2000, max_stop_strings=4, max_stop_chars=16,
              max_chat_messages=6, max_request_bytes=16 * 1024)  # fmt: skip
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}  # fmt: skip


@pytest.fixture(scope="module")
def served(frontend):
    """The cluster, served from an event loop in a thread; the tests call it blocking."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router-loop", daemon=True)
    thread.start()
    ready: concurrent.futures.Future = concurrent.futures.Future()

    async def hold():
        stop = asyncio.Event()
        async with cluster(frontend, **LIMITS) as c:
            ready.set_result((c, stop))
            await stop.wait()

    held = asyncio.run_coroutine_threadsafe(hold(), loop)
    try:
        c, stop = ready.result(timeout=60)
        with grpc.insecure_channel(c.router.address) as channel:
            yield c, channel
        loop.call_soon_threadsafe(stop.set)
        held.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)


CHARS = st.characters(exclude_categories=("Cs",))  # a proto string is valid UTF-8


def sized(n: int) -> st.SearchStrategy[str]:
    """Short unicode text, or a long run around ``n`` characters (cheap to draw)."""
    long = st.tuples(CHARS, st.integers(n - 2, n + 2)).map(lambda t: t[0] * t[1])
    return st.one_of(st.text(CHARS, max_size=12), long)


VALID_ROLE = st.sampled_from(["system", "user", "assistant"])
ANY_ROLE = st.one_of(
    VALID_ROLE,
    st.sampled_from(["", "robot", "User"]),
    st.text(CHARS, max_size=8),
    st.integers(30, 3000).map(lambda n: "r" * n),
)
# Half in the usual ranges, so that many requests pass and stream; half anything.
FLOATS = st.one_of(st.floats(0, 2, width=32), st.floats(width=32))
INT32 = st.integers(-(2**31), 2**31 - 1)

# Half the chats with valid roles only, so that whole chats reach the tokenizer often.
chats = st.one_of(*(
    st.lists(st.builds(tandem_pb2.ChatMessage, role=roles, content=sized(400)), max_size=8)
    for roles in (VALID_ROLE, ANY_ROLE)
))  # fmt: skip
samplings = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(-2, 64), INT32),
        "temperature": FLOATS, "top_p": FLOATS, "min_p": FLOATS, "repetition_penalty": FLOATS,
        "top_k": st.one_of(st.integers(-2, 64), INT32),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.lists(sized(16), max_size=6),
        "ignore_eos": st.booleans(),
    },
).map(lambda kw: tandem_pb2.SamplingParams(**kw))  # fmt: skip


@st.composite
def requests(draw) -> tandem_pb2.GenerateRequest:
    request_id = draw(st.one_of(st.from_regex(r"[A-Za-z0-9._:@+=-]{0,12}", fullmatch=True),
                                sized(200)))  # fmt: skip
    request = tandem_pb2.GenerateRequest(request_id=request_id, sampling=draw(samplings))
    # Rare "huge": gRPC takes ~0.2 s to refuse a message over max_request_bytes.
    kind = draw(st.sampled_from(["prompt"] * 16 + ["chat"] * 16 + ["none"] * 6 + ["huge"]))
    if kind == "prompt":
        request.prompt = draw(sized(2000))
    elif kind == "chat":
        request.chat.messages.extend(draw(chats))
        request.chat.SetInParent()
    elif kind == "huge":  # over max_request_bytes
        request.prompt = "é" * draw(st.integers(8000, 20000))
    return request


def call(channel, request) -> grpc.StatusCode:
    stub = tandem_pb2_grpc.TandemStub(channel)
    try:
        responses = list(stub.Generate(request, timeout=30))
    except grpc.RpcError as exc:
        return exc.code()
    assert responses[-1].finish_reason != tandem_pb2.FINISH_REASON_UNSPECIFIED
    return grpc.StatusCode.OK


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(request=requests())
def test_any_request_gets_ok_invalid_argument_or_resource_exhausted(served, request):
    c, channel = served
    code = call(channel, request)
    assert code in ALLOWED, (code, request)
    if (
        request.WhichOneof("input") is not None
        and request.ByteSize() <= LIMITS["max_request_bytes"]
    ):  # the same input through Tokenize
        tokenize = tandem_pb2.TokenizeRequest()
        if request.HasField("chat"):
            tokenize.chat.CopyFrom(request.chat)
        else:
            tokenize.prompt = request.prompt
        try:
            tandem_pb2_grpc.TandemStub(channel).Tokenize(tokenize, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (exc.code(), exc.details())


@pytest.mark.slow
def test_after_the_storm_the_router_serves_and_holds_nothing(served):
    """Runs after the property test (file order): health, slots and a normal stream."""
    c, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Tandem"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert c.router.admission.in_flight == 0
    assert call(channel, tandem_pb2.GenerateRequest(prompt="hello")) == grpc.StatusCode.OK
