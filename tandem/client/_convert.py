"""Client-side conversions: keyword arguments to requests, responses to dataclasses."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

import grpc

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.client.errors import InvalidRequest, TandemClientError
from tandem.client.types import (
    ChatMessage,
    Completion,
    FinishReason,
    GenerateChunk,
    Message,
    ModelInfo,
    TokenLogprob,
    Usage,
)

FLOAT32_TINY = 1.401298464324817e-45  # float32's smallest positive value (a subnormal)

_FINISH: dict[int, FinishReason] = {
    tandem_pb2.FINISH_REASON_STOP: "stop",
    tandem_pb2.FINISH_REASON_LENGTH: "length",
    tandem_pb2.FINISH_REASON_CANCELLED: "cancelled",
    tandem_pb2.FINISH_REASON_ERROR: "error",
}


# What the integer fields of SamplingParams hold (the others are float).
_KINDS = {"max_tokens": "a 32-bit integer", "top_k": "a 32-bit integer",
          "logprobs": "a 32-bit integer", "seed": "a signed 64-bit integer"}  # fmt: skip


def generate_request(
    prompt: str | None,
    messages: Sequence[Message] | None,
    request_id: str,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    repetition_penalty: float | None,
    stop: Iterable[str],
    ignore_eos: bool,
    logprobs: int | None = None,
) -> tandem_pb2.GenerateRequest:
    if not isinstance(request_id, str):
        raise _invalid(f"request_id must be a string, got {request_id!r}")
    if not isinstance(ignore_eos, bool):
        raise _invalid(f"ignore_eos must be True or False, got {ignore_eos!r}")
    request = tandem_pb2.GenerateRequest(request_id=request_id)
    _set_input(request, prompt, messages)
    s = request.sampling
    # Unset stays unset: the server applies its documented defaults.
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("seed", seed),
        ("repetition_penalty", repetition_penalty),
        ("logprobs", logprobs),
    ):
        if value is not None:
            if isinstance(value, bool):  # True is no temperature, nor a token count
                raise _invalid(f"{name} must be {_KINDS.get(name, 'a number')}, got {value!r}")
            try:
                setattr(s, name, value)
            except (TypeError, ValueError, OverflowError):  # another type, or past the range
                raise InvalidRequest(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{name} must be {_KINDS.get(name, 'a number')}, got {value!r}",
                ) from None
            if math.isinf(getattr(s, name)) and not math.isinf(value):  # float32's range
                raise InvalidRequest(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{name} must be within float32's range, got {value!r}",
                )
            if getattr(s, name) == 0 and value != 0:
                # Under float32's range: float32's smallest of its sign, not the 0 the
                # router would judge (top_p 1e-50, in (0, 1], was refused as "got 0.0";
                # temperature 1e-50 became greedy). What the field takes is the router's
                # to say, naming the value it got.
                setattr(s, name, math.copysign(FLOAT32_TINY, value))
    stops = [stop] if isinstance(stop, str) else list(stop or ())  # one string, not its letters
    if not all(isinstance(x, str) for x in stops):
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT, f"stop must be strings, got {stop!r}"
        )
    s.stop.extend(stops)
    s.ignore_eos = ignore_eos
    return request


# A deadline this far off is none: gRPC takes one past its clock's range as already past.
NO_DEADLINE_S = 1e9


def deadline(timeout: float | None) -> float | None:
    """A call's gRPC timeout for a client's ``timeout`` (seconds; None or inf: none)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    return None if math.isinf(timeout) or timeout >= NO_DEADLINE_S else float(timeout)


def tokenize_request(
    prompt: str | None, messages: Sequence[Message] | None
) -> tandem_pb2.TokenizeRequest:
    request = tandem_pb2.TokenizeRequest()
    _set_input(request, prompt, messages)
    return request


def _set_input(request, prompt: str | None, messages: Sequence[Message] | None) -> None:
    if (prompt is None) == (messages is None):
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of prompt or messages"
        )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise _invalid(f"prompt must be a string, got a {type(prompt).__name__}")
        request.prompt = prompt
        return
    if isinstance(messages, (str, Mapping)):  # one message, not a list of them
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"messages must be a list of messages, got a {type(messages).__name__}",
        )
    for i, m in enumerate(messages or ()):
        try:
            if isinstance(m, ChatMessage):
                role, content = m.role, m.content
            else:
                role, content = m["role"], m["content"]
            if not (isinstance(role, str) and isinstance(content, str)):
                raise TypeError  # None went as "", bytes as their decoding
            request.chat.messages.add(role=role, content=content)
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"messages[{i}] must have a string role and content, got {m!r}",
            ) from None
    request.chat.SetInParent()  # an empty list is still "chat", which the server refuses


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


def chunk(response: tandem_pb2.GenerateResponse) -> GenerateChunk:
    last = response.finish_reason != tandem_pb2.FINISH_REASON_UNSPECIFIED
    return GenerateChunk(
        request_id=response.request_id,
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=_FINISH.get(response.finish_reason) if last else None,
        usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens)
        if last
        else None,
        logprobs=tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
            for lp in response.logprobs
        ),
    )


def model_info(info: tandem_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(info.model_id, info.context_length, info.vocab_size)


class CompletionBuilder:
    """Joins a stream of chunks into one ``Completion``."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: GenerateChunk | None = None

    def add(self, c: GenerateChunk) -> None:
        self._text.append(c.text)
        self._ids.extend(c.token_ids)
        self._logprobs.extend(c.logprobs)
        self._last = c

    def build(self) -> Completion:
        last = self._last
        if last is None or last.finish_reason is None or last.usage is None:
            raise TandemClientError(
                grpc.StatusCode.INTERNAL, "the stream ended without a final response"
            )
        return Completion(
            last.request_id, "".join(self._text), tuple(self._ids), last.finish_reason,
            last.usage, tuple(self._logprobs),
        )  # fmt: skip
