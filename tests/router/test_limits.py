"""Input limits (INVALID_ARGUMENT naming the field and the limit, before tokenizing),
the message-size bound, and tokenizing off the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import AsyncTandemClient, InvalidRequest, Overloaded, RequestTooLarge
from tandem.config import RouterConfig
from tandem.errors import ConfigError
from tandem.router.frontend import Frontend
from tests.router.fakes import FakeDecode, cluster, wait_until

S = tandem_pb2.SamplingParams
M = tandem_pb2.ChatMessage
SMALL = dict(max_prompt_chars=100, max_stop_strings=2, max_stop_chars=5, max_chat_messages=3)


def run(coro):
    return asyncio.run(coro)


class SpyTokenizer:
    """Wraps the real tokenizer; records each call, and sleeps (without the GIL, as the
    real one encodes) on texts longer than ``slow_above`` characters."""

    def __init__(self, inner, slow_above: int | None = None, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.slow_above = slow_above
        self.delay_s = delay_s
        self.calls: list[int] = []  # lengths of what was tokenized
        self.slow_started = threading.Event()

    def _maybe_slow(self, n: int) -> None:
        self.calls.append(n)
        if self.slow_above is not None and n > self.slow_above:
            self.slow_started.set()
            time.sleep(self.delay_s)

    def encode(self, text: str) -> list[int]:
        self._maybe_slow(len(text))
        return self.inner.encode(text)

    def encode_chat(self, messages) -> list[int]:
        self._maybe_slow(sum(len(m["content"]) for m in messages))
        return self.inner.encode_chat(messages)


def spied(frontend: Frontend, **kw) -> tuple[Frontend, SpyTokenizer]:
    spy = SpyTokenizer(frontend.tokenizer, **kw)
    return Frontend("tiny-random", spy, frontend.context_length, frontend.vocab_size), spy


async def _generate(channel, **fields):
    stub = tandem_pb2_grpc.TandemStub(channel)
    return [r async for r in stub.Generate(tandem_pb2.GenerateRequest(**fields), timeout=10)]


def chat(*messages: tuple[str, str]) -> tandem_pb2.Chat:
    return tandem_pb2.Chat(messages=[M(role=r, content=c) for r, c in messages])


CASES = [
    (dict(prompt="x" * 101), "prompt must be at most 100 characters, got 101"),
    (dict(prompt="hi", sampling=S(stop=["a", "b", "c"])), "stop must be at most 2 strings, got 3"),
    (dict(prompt="hi", sampling=S(stop=["ok", "toolong"])),
     "stop[1] must be at most 5 characters, got 7"),
    (dict(chat=chat(*[("user", "a")] * 4)), "chat.messages must be at most 3 messages, got 4"),
    (dict(chat=chat(("system", "x" * 60), ("user", "y" * 41))),
     "chat.messages content must be at most 100 characters in all, got 101"),
    (dict(chat=chat(("user", "a"), ("r" * 10**5, "b"))),
     "chat.messages[1].role must be one of system, user, assistant, got a 100000-character "
     "string"),
    (dict(request_id="r" * 201, prompt="hi"), "request_id must be at most 200 characters, got 201"),
    # "/" is the router's, for a call's id on the workers ("x/3f9a2c-1" could be another
    # client's "x" there); a newline would forge a log line.
    (dict(request_id="x/1", prompt="hi"), "request_id may hold only ASCII letters, digits and "
     ". _ : @ + = -, got U+002F at character 1"),
    (dict(request_id="ok\n[evil]", prompt="hi"), "request_id may hold only ASCII letters, "
     "digits and . _ : @ + = -, got U+000A at character 2"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields, message", CASES, ids=[m.split(" must")[0].split(" may")[0] for _, m in CASES]
)
def test_each_input_limit_names_its_field_and_limit_before_tokenizing(frontend, fields, message):
    async def scenario():
        front, spy = spied(frontend)
        async with cluster(front, **SMALL) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(c.client._channel, **fields)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == message
            assert spy.calls == [] and c.worker_calls() == 0

    run(scenario())


def test_inputs_at_the_limits_are_served(frontend):
    async def scenario():
        async with cluster(frontend, **SMALL) as c:
            channel = c.client._channel
            assert await _generate(channel, prompt="x" * 100, sampling=S(stop=["abcde", "b"]))
            three = chat(("system", "x" * 50), ("user", "y" * 25), ("assistant", "z" * 25))
            assert await _generate(channel, chat=three, request_id="r" * 200)
            assert await c.client.tokenize("x" * 100)

    run(scenario())


def test_tokenize_has_the_same_input_limits(frontend):
    async def scenario():
        front, spy = spied(frontend)
        async with cluster(front, **SMALL) as c:
            from tandem.client import InvalidRequest

            with pytest.raises(InvalidRequest, match="prompt must be at most 100 characters"):
                await c.client.tokenize("x" * 101)
            with pytest.raises(InvalidRequest, match="chat.messages must be at most 3"):
                await c.client.tokenize(messages=[{"role": "user", "content": "a"}] * 4)
            assert spy.calls == []

    run(scenario())


def test_the_default_prompt_limit_is_32_characters_per_token_of_context(frontend):
    """tiny-random: a 4096-token context, so 131072 characters; one more is refused
    without the tokenizer ever seeing it."""

    async def scenario():
        front, spy = spied(frontend)
        async with cluster(front) as c:
            assert c.router.frontend.limits.max_prompt_chars == 32 * 4096
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(c.client._channel, prompt="x" * (32 * 4096 + 1))
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == "prompt must be at most 131072 characters, got 131073"
            assert spy.calls == []

    run(scenario())


def test_a_message_over_max_request_bytes_is_too_large_not_overloaded(frontend):
    # gRPC refuses it with RESOURCE_EXHAUSTED, which the client raised as Overloaded,
    # "retry later": a caller following that advice retried for ever.
    async def scenario():
        async with cluster(frontend, max_request_bytes=4096) as c:
            with pytest.raises(RequestTooLarge, match="larger than max") as info:
                await c.client.complete("x" * 5000)
            assert isinstance(info.value, InvalidRequest)
            assert not isinstance(info.value, Overloaded)
            with pytest.raises(RequestTooLarge, match="metadata size exceeds"):
                await AsyncTandemClient(c.router.address, api_key="k" * 20000).complete("x")
            assert await c.client.complete("x" * 3000)
            assert c.worker_calls() == 2  # the first never reached the router's code

    run(scenario())


def test_a_big_prompt_tokenizes_off_the_event_loop(frontend):
    """While one prompt takes 2 s to tokenize, other calls are answered and another
    stream runs to its end: nothing waits for the tokenizer but its own request."""

    async def scenario():
        front, spy = spied(frontend, slow_above=1000, delay_s=4.0)
        async with cluster(front) as c:
            big = asyncio.create_task(c.client.complete("x" * 3000, max_tokens=8))
            await asyncio.to_thread(spy.slow_started.wait, 10)
            t0 = time.monotonic()
            await c.client.model_info()
            small = await c.client.complete("hello", max_tokens=8)
            elapsed = time.monotonic() - t0
            assert not big.done(), "the big prompt finished first: the test proves nothing"
            assert small.finish_reason == "length" and elapsed < 3.0, elapsed
            assert (await big).finish_reason == "length"

    run(scenario())


def test_tokenize_is_admitted_like_generate(frontend):
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], max_queue=1) as c:
            first = asyncio.create_task(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="placed")
            with pytest.raises(Overloaded, match=r"max_queue=1"):
                await c.client.tokenize("hello")
            decode.gate.set()
            await first
            assert await c.client.tokenize("hello")

    run(scenario())


def test_a_flood_of_overloaded_requests_does_not_flood_the_log(frontend, caplog):
    # A line per refusal, at the rate requests arrive.
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], max_queue=1) as c:
            first = asyncio.create_task(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="placed")
            with caplog.at_level(logging.INFO, logger="tandem.router"):
                for _ in range(50):
                    with pytest.raises(Overloaded):
                        await c.client.complete("hello")
            decode.gate.set()
            await first

    run(scenario())
    refusals = [r.getMessage() for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()]
    assert len(refusals) == 1, refusals  # the first; the rest are counted in the next one


def test_a_throttled_line_says_how_many_were_left_out_kind_by_kind(monkeypatch, caplog):
    from tandem import logs

    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    throttle = logs.Throttle(logging.getLogger("tandem.test"), every_s=10)
    with caplog.at_level(logging.INFO, logger="tandem.test"):
        for t, who in (
            (100.0, "alice"),
            (101.0, "alice"),
            (102, "bob"),
            (105.0, "alice"),
            (106, "bob"),
            (110.0, "alice"),
            (111.0, "alice"),
            (125.0, "alice"),
        ):
            now[0] = t
            throttle.log(logging.INFO, "%s refused at %s", who, t, kind=who)
        throttle.flush()  # the router's stop: counts held with no line after them
    assert [r.getMessage() for r in caplog.records] == [
        "alice refused at 100.0",
        "bob refused at 102",  # another key's line is not held behind alice's
        "alice refused at 110.0 (and 2 more like it since the last one logged)",
        "alice refused at 125.0 (and 1 more like it since the last one logged)",
        "1 lines like this one were not logged: bob refused at 106",
    ]


def test_past_its_bound_of_kinds_a_throttle_still_throttles(caplog):
    # The least recent kind was forgotten to make room, so with more kinds at once
    # than the bound every line was logged.
    from tandem import logs

    throttle = logs.Throttle(logging.getLogger("tandem.test"), every_s=60)
    with caplog.at_level(logging.INFO, logger="tandem.test"):
        for _ in range(20):
            for key in range(300):
                throttle.log(logging.INFO, "key %d refused", key, kind=key)
    assert len(caplog.records) == logs.Throttle.KINDS + 1  # one per kind, one for the rest


@pytest.mark.parametrize(
    "settings, message",
    [({"max_prompt_chars": 0}, "max_prompt_chars must be >= 1, got 0"),
     ({"max_stop_strings": 0}, "max_stop_strings must be >= 1, got 0"),
     ({"max_stop_chars": 0}, "max_stop_chars must be >= 1, got 0"),
     ({"max_chat_messages": 0}, "max_chat_messages must be >= 1, got 0"),
     ({"max_request_bytes": 100}, "max_request_bytes must be in [1024, 2,147,483,647], got 100"),
     ({"key_max_streams": -1}, "key_max_streams must be >= 0 (0: no limit), got -1"),
     ({"key_requests_per_s": float("inf")},
      "key_requests_per_s must be finite and >= 0 (0: no limit), got inf")],
)  # fmt: skip
def test_bad_limit_settings_are_named(settings, message):
    with pytest.raises(ConfigError) as info:
        RouterConfig(**settings)
    assert str(info.value) == message
