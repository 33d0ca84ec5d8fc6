"""Protobuf <-> internal conversions: defaults, round trips and named errors."""

from __future__ import annotations

import pytest

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason
from tandem.errors import InvalidRequestError
from tandem.wire import (
    DEFAULT_MAX_TOKENS,
    chat_from_proto,
    finish_from_proto,
    finish_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    worker_request,
)


def test_unset_fields_take_the_documented_defaults():
    assert sampling_from_proto(tandem_pb2.SamplingParams()) == SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS
    )


def test_round_trip_keeps_every_field():
    s = SamplingParams(
        max_tokens=9, temperature=0.0, top_p=0.5, top_k=3, min_p=0.25,
        repetition_penalty=1.5, seed=-4, stop=("a", "bc"), ignore_eos=True,
    )  # fmt: skip
    assert sampling_from_proto(sampling_to_proto(s)) == s


def test_the_documented_bounds_pass_through_the_float32_fields():
    # 1e-5 is 9.9999997e-06 in float32, 0.01 is 0.0099999998: just under the bounds.
    edge = sampling_from_proto(tandem_pb2.SamplingParams(temperature=1e-5,
                                                         repetition_penalty=0.01))  # fmt: skip
    assert edge.temperature == pytest.approx(1e-5) and edge.repetition_penalty == pytest.approx(
        0.01
    )
    with pytest.raises(InvalidRequestError, match="at least 1e-05, got 9.9e-06"):
        sampling_from_proto(tandem_pb2.SamplingParams(temperature=9.9e-6))


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"temperature": -1.0}, "temperature", "temperature must be finite and >= 0, got -1.0"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -1}, "top_k", "top_k must be >= 0 (0 disables it), got -1"),
        ({"min_p": 2.0}, "min_p", "min_p must be in [0, 1], got 2.0"),
        ({"stop": [""]}, "stop", "stop strings must be non-empty, got an empty stop[0]"),
    ],
)
def test_bad_values_name_the_field(fields, field, message):
    with pytest.raises(InvalidRequestError) as err:
        sampling_from_proto(tandem_pb2.SamplingParams(**fields))
    assert err.value.field == field and str(err.value) == message


def test_chat_roles_are_checked():
    chat = tandem_pb2.Chat(messages=[tandem_pb2.ChatMessage(role="user", content="hi")])
    assert chat_from_proto(chat) == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match=r"chat.messages\[0\].role must be one of"):
        chat_from_proto(tandem_pb2.Chat(messages=[tandem_pb2.ChatMessage(role="robot")]))
    with pytest.raises(InvalidRequestError, match="chat.messages must not be empty"):
        chat_from_proto(tandem_pb2.Chat())


def test_finish_reasons_round_trip():
    for reason in (None, *FinishReason):
        assert finish_from_proto(finish_to_proto(reason)) is reason


def test_worker_request_carries_earlier_output_only_when_given():
    params = SamplingParams(max_tokens=9, temperature=0)
    moved = worker_request("r", [1, 2], params, [3, 4])
    again = worker_pb2.WorkerRequest.FromString(moved.SerializeToString())
    assert list(again.prompt_token_ids) == [1, 2] and list(again.output_token_ids) == [3, 4]
    assert list(worker_request("r", [1, 2], params).output_token_ids) == []
