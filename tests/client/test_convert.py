"""Requests from keyword arguments, dataclasses from responses, exceptions from statuses."""

from __future__ import annotations

import math
import re

import grpc
import pytest

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.client import (
    Cancelled,
    ChatMessage,
    DeadlineExceeded,
    GenerateChunk,
    InvalidRequest,
    Overloaded,
    TandemClientError,
    Unavailable,
    Usage,
    _convert,
)
from tandem.client.errors import from_rpc_error

NO_SAMPLING = dict(
    max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None, seed=None,
    repetition_penalty=None, stop=(), ignore_eos=False,
)  # fmt: skip


def test_unset_sampling_stays_unset_for_the_server_defaults():
    request = _convert.generate_request("hi", None, "", **NO_SAMPLING)
    assert request.prompt == "hi" and request.request_id == ""
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        assert not request.sampling.HasField(name), name


def test_set_sampling_is_sent_including_zeroes():
    values = {**NO_SAMPLING, "max_tokens": 7, "temperature": 0.0, "top_k": 0, "seed": 3}
    values["stop"] = ["\n"]
    request = _convert.generate_request("hi", None, "id-1", **values)
    s = request.sampling
    assert s.HasField("temperature") and s.temperature == 0.0 and s.HasField("top_k")
    assert (s.max_tokens, s.seed, list(s.stop), request.request_id) == (7, 3, ["\n"], "id-1")


@pytest.mark.parametrize(("name", "value"), [("top_p", 1e-50), ("temperature", -1e-50)])
def test_a_value_under_float32s_range_goes_as_its_smallest_not_as_zero(name, value):
    # As 0, the router refused top_p 1e-50 (in (0, 1]) as "got 0.0" and served a
    # temperature of 1e-50 greedy; now it judges float32's smallest of the same sign.
    from tandem.client._convert import FLOAT32_TINY

    request = _convert.generate_request("hi", None, "", **{**NO_SAMPLING, name: value})
    assert getattr(request.sampling, name) == math.copysign(FLOAT32_TINY, value)


def test_one_stop_string_is_one_stop_string_not_its_letters():
    request = _convert.generate_request("hi", None, "", **{**NO_SAMPLING, "stop": "END"})
    assert list(request.sampling.stop) == ["END"]


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("seed", 2**64 - 1, "seed must be a signed 64-bit integer, got 18446744073709551615"),
        ("max_tokens", 2**31, "max_tokens must be a 32-bit integer, got 2147483648"),
        ("max_tokens", 1.5, "max_tokens must be a 32-bit integer, got 1.5"),
        ("temperature", "hot", "temperature must be a number, got 'hot'"),
        # It went out as inf, and the router's error named a value nobody had sent.
        ("temperature", 1e39, "temperature must be within float32's range, got 1e+39"),
        ("temperature", 10**400, f"temperature must be a number, got {10**400!r}"),
        ("stop", [1], "stop must be strings, got [1]"),
        # A bool went out as 1.0; a non-bool ignore_eos was a raw TypeError.
        ("temperature", True, "temperature must be a number, got True"),
        ("ignore_eos", "no", "ignore_eos must be True or False, got 'no'"),
        ("ignore_eos", None, "ignore_eos must be True or False, got None"),
    ],
)
def test_a_value_its_field_cannot_hold_is_an_invalid_request(name, value, message):
    with pytest.raises(InvalidRequest) as info:
        _convert.generate_request("hi", None, "", **{**NO_SAMPLING, name: value})
    assert info.value.details == message


@pytest.mark.parametrize(
    "prompt, request_id, message",
    [(123, "", "prompt must be a string, got a int"),
     (b"\xff", "", "prompt must be a string, got a bytes"),
     ("hi", 123, "request_id must be a string, got 123")],
)  # fmt: skip
def test_a_prompt_or_request_id_that_is_no_string_is_an_invalid_request(
    prompt, request_id, message
):
    # A raw TypeError or UnicodeDecodeError, naming nothing.
    with pytest.raises(InvalidRequest) as info:
        _convert.generate_request(prompt, None, request_id, **NO_SAMPLING)
    assert info.value.details == message


def test_messages_accept_dataclasses_and_mappings():
    msgs = [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}]
    request = _convert.generate_request(None, msgs, "", **NO_SAMPLING)
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    # An empty list is still a chat, for the server to refuse with the field named.
    assert _convert.tokenize_request(None, []).WhichOneof("input") == "chat"


def test_no_stop_is_none_as_well():  # as OpenAI-style code passes it
    request = _convert.generate_request("hi", None, "", **{**NO_SAMPLING, "stop": None})
    assert list(request.sampling.stop) == []


@pytest.mark.parametrize(
    "messages, message",
    [
        ({"role": "user", "content": "hi"}, "messages must be a list of messages, got a dict"),
        ([{"role": "user"}], "messages[0] must have a string role and content"),
        ([{"role": "user", "content": 7}], "messages[0] must have a string role and content"),
        # These went out as an empty content, or a role the router named as ''.
        ([{"role": "user", "content": None}], "messages[0] must have a string role and"),
        ([{"role": None, "content": "hi"}], "messages[0] must have a string role and"),
        ([{"role": "user", "content": b"hi"}], "messages[0] must have a string role and"),
    ],
)
def test_malformed_messages_are_an_invalid_request_naming_them(messages, message):
    # A raw TypeError or KeyError, where every other argument gave InvalidRequest.
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        _convert.generate_request(None, messages, "", **NO_SAMPLING)


@pytest.mark.parametrize("prompt, messages", [(None, None), ("hi", [])])
def test_exactly_one_of_prompt_or_messages(prompt, messages):
    with pytest.raises(InvalidRequest, match="exactly one of prompt or messages"):
        _convert.tokenize_request(prompt, messages)


def test_chunks_carry_usage_and_finish_only_at_the_end():
    mid = tandem_pb2.GenerateResponse(request_id="r", text="a", token_ids=[1])
    assert _convert.chunk(mid) == GenerateChunk("r", "a", (1,))
    last = tandem_pb2.GenerateResponse(
        request_id="r",
        finish_reason=tandem_pb2.FINISH_REASON_LENGTH,
        usage=tandem_pb2.Usage(prompt_tokens=3, completion_tokens=2),
    )
    assert _convert.chunk(last) == GenerateChunk("r", "", (), "length", Usage(3, 2))


class _Error(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.INTERNAL, TandemClientError),
    ],
)
def test_statuses_map_to_exceptions(code, cls):
    exc = from_rpc_error(_Error(code, "max_tokens must be >= 1, got 0"))
    assert type(exc) is cls and exc.code is code
    assert str(exc) == f"{code.name}: max_tokens must be >= 1, got 0"
    assert exc.details == "max_tokens must be >= 1, got 0"
