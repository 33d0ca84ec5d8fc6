"""The generated requests of test_fuzz.py through real workers: a router in front of a
tiny-random prefill and decode worker joined by UCX. Every answer is OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED; afterwards the router is SERVING and no
KV block is left used on either worker (their pools check out consistent).

The context is cut to 96 tokens so that a valid request streams at most a few
dozen tokens. Half the examples are test_fuzz.py's (mostly invalid, cheap), half
are drawn from valid ranges (short prompts and chats, sane sampling) so that
many really stream, stop early or are cut by their stop strings.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.config import DecodeConfig, PrefillConfig, RouterConfig
from tandem.router.server import Router
from tests.router.test_fuzz import ALLOWED, CHARS, LIMITS, VALID_ROLE, call, requests
from tests.workers import BackgroundLoop, Pair, engine_config, start_worker, stop_worker

CONTEXT = 96

short = st.text(CHARS, min_size=1, max_size=24)
valid_sampling = st.builds(
    tandem_pb2.SamplingParams,
    max_tokens=st.integers(1, 16),
    temperature=st.floats(0, 1.5),
    top_p=st.floats(0.05, 1),
    top_k=st.integers(0, 50),
    seed=st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(CHARS, min_size=1, max_size=3), max_size=3),
    ignore_eos=st.booleans(),
)


def _request(prompt, messages, sampling, rid) -> tandem_pb2.GenerateRequest:
    text = {"prompt": prompt} if messages is None else {"chat": tandem_pb2.Chat(messages=messages)}
    return tandem_pb2.GenerateRequest(request_id=rid, sampling=sampling, **text)


valid_requests = st.builds(
    _request,
    short,
    st.none()
    | st.lists(
        st.builds(tandem_pb2.ChatMessage, role=VALID_ROLE, content=short), min_size=1, max_size=2
    ),  # fmt: skip
    valid_sampling,
    st.text(CHARS, max_size=20),
)


@pytest.fixture(scope="module")
def served():
    bg = BackgroundLoop()
    engine = engine_config(max_model_len=CONTEXT, num_blocks=128)
    pair = Pair(
        start_worker(bg, PrefillConfig(engine=engine, kv_ack_timeout_s=10)),
        start_worker(bg, DecodeConfig(engine=engine, kv_lease_s=10)),
    )
    config = RouterConfig(
        model="tiny-random", port=0, max_model_len=CONTEXT, max_queue=4,
        prefill_workers=(pair.prefill.server.address,),
        decode_workers=(pair.decode.server.address,),
        **LIMITS,
    )  # fmt: skip
    router = Router(config)
    bg.run(router.start(), timeout=60)
    try:
        with grpc.insecure_channel(router.address) as channel:
            yield router, pair, channel
    finally:
        bg.run(router.stop(grace=1.0))
        stop_worker(bg, pair.prefill)
        stop_worker(bg, pair.decode)
        bg.close()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(request=st.one_of(requests(), valid_requests))
def test_any_request_through_real_workers_gets_an_allowed_answer(served, request):
    _, _, channel = served
    code = call(channel, request)
    assert code in ALLOWED, (code, request)


@pytest.mark.slow
def test_after_the_storm_no_kv_block_is_left_used(served):
    router, pair, channel = served
    pair.check_clean()  # both pools empty and consistent
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Tandem"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert router.admission.in_flight == 0
