"""Multi-turn chats: each follow-up turn carries the reply its earlier turn got."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.bench.load import datasets
from tandem.bench.load.datasets import RequestSpec
from tandem.bench.load.runner import DatasetConfig, LoadConfig, run_async
from tandem.errors import InvalidRequestError
from tests.router.conftest import frontend  # noqa: F401 - the fixture
from tests.router.fakes import cluster


def _chat(*messages: tuple[str, str]) -> RequestSpec:
    return RequestSpec(messages=messages)


def _run_against_fakes(frontend, dataset: DatasetConfig, num_requests: int):  # noqa: F811
    """The run's result, and the requests the decode worker got, in arrival order: a
    router with scripted workers, which answer every request with five tokens."""

    async def scenario():
        async with cluster(frontend) as c:
            config = LoadConfig(target=c.router.address, num_requests=num_requests,
                                num_warmup=0, dataset=dataset, progress=False)  # fmt: skip
            return await run_async(config), [call.request.request for call in c.decode[0].calls]

    return asyncio.run(scenario())


def test_follow_ups_link_each_turn_to_the_latest_one_it_repeats():
    s, u1, a1, u2, a2, u3 = (("system", "s"), ("user", "1"), ("assistant", "x"),
                             ("user", "2"), ("assistant", "y"), ("user", "3"))  # fmt: skip
    specs = [
        _chat(s, u1),  # 0
        _chat(s, ("user", "other")),  # 1: another user
        _chat(s, u1, a1, u2),  # 2: follows 0, its reply at message 2
        _chat(s, u1, a1, u2, a2, u3),  # 3: follows 2, not 0
        _chat(s, u1),  # 4: the file cycled
        _chat(s, u1, a1, u2),  # 5: follows 4, the latest
        _chat(u1, a1, u2),  # 6: nothing sent ends before its assistant turn
        RequestSpec(prompt="plain"),  # 7
    ]
    assert datasets.follow_ups(specs) == [None, None, (0, 2), (2, 4), None, (4, 2), None, None]


def test_multi_turn_is_for_files_of_chats_in_their_order():
    with pytest.raises(InvalidRequestError, match="--multi-turn is for jsonl and sharegpt"):
        DatasetConfig(multi_turn=True)
    with pytest.raises(InvalidRequestError, match="needs --dataset-in-order"):
        DatasetConfig(kind="jsonl", path="chats.jsonl", multi_turn=True)
    sharegpt = DatasetConfig(kind="sharegpt", path="x.json", multi_turn=True)  # whole chats
    assert sharegpt.describe() == "sharegpt x.json, multi-turn"


def test_follow_ups_are_sent_with_the_reply_their_earlier_turn_got(frontend, tmp_path):  # noqa: F811
    system = ("system", "be brief")
    turn1 = [system, ("user", "hello")]
    turn2 = [*turn1, ("assistant", "filler"), ("user", "and then?")]
    other = [system, ("user", "another user")]
    lines = [turn1, other, turn2]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in m],
                                        "output_len": 5}) + "\n" for m in lines))  # fmt: skip
    dataset = DatasetConfig(kind="jsonl", path=str(path), in_order=True, multi_turn=True)
    result, calls = _run_against_fakes(frontend, dataset, 3)
    assert result.summary.completed == 3
    # The fakes answer every request with the same five tokens and their text.
    reply = "<10><11><12><13><14>"
    expected = [*turn1, ("assistant", reply), ("user", "and then?")]
    assert [s.messages for s in result.sent] == [tuple(turn1), tuple(other), tuple(expected)]
    chat = [{"role": r, "content": c} for r, c in expected]
    assert list(calls[2].prompt_token_ids) == frontend.tokenizer.encode_chat(chat)
    # The follow-up left after its earlier turn had ended, and was timed from then.
    first, _, follow = result.records
    assert follow.send_time >= first.send_time + first.end_time
    assert follow.input_len is None and follow.prompt_tokens == len(calls[2].prompt_token_ids)


def test_each_send_of_a_follow_up_waits_for_the_send_of_its_turn_scheduled_before_it():
    from tandem.bench.load.runner import _Turns

    first = _chat(("user", "1"))
    second = _chat(("user", "1"), ("assistant", "filler"), ("user", "2"))

    async def scenario():
        turns = _Turns([first, second], multi_turn=True)
        a = turns.start(0)
        assert (await turns.ready(a)).messages == first.messages
        f1 = turns.start(1)
        b = turns.start(0)  # the file cycled while the first send of 0 is in flight
        await turns.ready(b)
        f2 = turns.start(1)
        waiting = [asyncio.ensure_future(turns.ready(f)) for f in (f1, f2)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)
        turns.done(a, "first reply")  # the first send's reply: only f1 goes
        sent = await asyncio.wait_for(waiting[0], 10)
        assert sent.messages[1] == ("assistant", "first reply") and not waiting[1].done()
        turns.done(b, None)  # the second send failed: the file's text stands in
        assert (await waiting[1]).messages == second.messages
        # A follow-up whose turn was never sent goes as the file has it.
        assert (await turns.ready(_Turns([first, second], True).start(1))) == second

    asyncio.run(scenario())


def test_a_sharegpt_conversation_is_replayed_turn_by_turn_with_the_servers_replies(
    frontend,  # noqa: F811
    tmp_path,
):
    def turn(who, text):
        return {"from": who, "value": text}

    conversation = [turn("human", "tell me about caches please"),
                    turn("gpt", "a stand-in reply of the file"),
                    turn("human", "and about their eviction policy?"),
                    turn("gpt", "another stand-in reply here")]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": conversation}]))
    dataset = DatasetConfig(kind="sharegpt", path=str(path), multi_turn=True,
                            file_output_len=5)  # fmt: skip
    result, calls = _run_against_fakes(frontend, dataset, 2)
    assert result.summary.completed == 2
    expected = [{"role": "user", "content": "tell me about caches please"},
                {"role": "assistant", "content": "<10><11><12><13><14>"},
                {"role": "user", "content": "and about their eviction policy?"}]  # fmt: skip
    assert list(calls[1].prompt_token_ids) == frontend.tokenizer.encode_chat(expected)


class _Timed:
    """A client whose replies take ``delay`` seconds (the first one ``first_delay``),
    counting the requests in flight."""

    def __init__(self, delay: float, first_delay: float | None = None) -> None:
        self.delay, self.first_delay = delay, first_delay
        self.sent = self.in_flight = self.most_in_flight = 0

    def __call__(self, *args, **kwargs):  # stands in for the client class
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def model_info(self, timeout=None):
        from tandem.client.types import ModelInfo

        return ModelInfo("fake", 4096, 100)

    async def tokenize(self, **kwargs):
        return [1] * 10

    async def generate(self, **kwargs):
        from tandem.client.types import GenerateChunk, Usage

        self.sent += 1
        delay = self.first_delay if self.sent == 1 and self.first_delay else self.delay
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(delay)
        finally:
            self.in_flight -= 1
        yield GenerateChunk("r", "reply", (1,), "length", Usage(10, 1))


def _conversations(path, chats: int, turns: int) -> DatasetConfig:
    with path.open("w") as f:
        for c in range(chats):  # each chat's turns on consecutive lines
            history: list[dict] = []
            for t in range(turns):
                history = [*history, {"role": "user", "content": f"chat {c} turn {t}"}]
                f.write(json.dumps({"messages": history, "output_len": 1}) + "\n")
                history = [*history, {"role": "assistant", "content": "filler"}]
    return DatasetConfig(kind="jsonl", path=str(path), in_order=True, multi_turn=True)


def test_follow_ups_waiting_for_replies_hold_no_concurrency_slot(tmp_path, monkeypatch):
    from tandem.bench.load import runner

    client = _Timed(delay=0.05)
    monkeypatch.setattr(runner, "AsyncTandemClient", client)
    dataset = _conversations(tmp_path / "chats.jsonl", chats=10, turns=4)
    config = LoadConfig(target="fake", num_requests=40, max_concurrency=4, num_warmup=0,
                        dataset=dataset, progress=False)  # fmt: skip
    result = asyncio.run(run_async(config))
    assert result.summary.completed == 40
    # Four chats' turns in flight at once, not one chat's turn and its waiting follow-ups.
    assert client.most_in_flight == 4


def _duration_run(monkeypatch, client, dataset, pool: int, **settings):
    """A --duration run of ``dataset`` against ``client`` (cycling ``pool`` requests),
    failed if it has not ended within 30 s."""
    from tandem.bench.load import runner

    monkeypatch.setattr(runner, "AsyncTandemClient", client)
    monkeypatch.setattr(runner, "DURATION_POOL", pool)
    config = LoadConfig(target="fake", num_requests=None, dataset=dataset, progress=False,
                        **settings)  # fmt: skip

    async def bounded():
        return await asyncio.wait_for(run_async(config), 30)

    return asyncio.run(bounded())


class _Prompts(_Timed):
    """Counts a prompt's words as its tokens, and keeps every prompt sent."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.prompts: list[str] = []

    async def tokenize(self, prompt=None, **kwargs):
        return [1] * (1 + len(prompt.split()))

    async def generate(self, **kwargs):
        self.prompts.append(kwargs["prompt"])
        async for chunk in super().generate(**kwargs):
            yield chunk


def test_a_synthetic_duration_run_draws_new_prompts_rather_than_send_them_again(monkeypatch):
    # Sent again, a prompt would be a prefix-cache hit: the run would measure memory.
    from tandem.bench.load.datasets import LengthDist

    client = _Prompts(delay=0.002)
    dataset = DatasetConfig(input_len=LengthDist("fixed", 40), output_len=LengthDist("fixed", 1))
    result = _duration_run(monkeypatch, client, dataset, pool=8, duration_s=0.5,
                           max_concurrency=4, num_warmup=0)  # fmt: skip
    assert result.summary.completed == len(client.prompts) > 3 * 8  # past the pool, thrice
    assert len(set(client.prompts)) == len(client.prompts)
    assert {len(p.split()) for p in client.prompts} == {39}  # 40 tokens, as asked


def test_a_cycled_duration_run_ends_though_a_turn_is_in_flight_when_it_comes_round(
    tmp_path, monkeypatch
):
    client = _Timed(delay=0.005, first_delay=0.5)  # chat 0's first turn is slow
    dataset = _conversations(tmp_path / "chats.jsonl", chats=2, turns=2)
    result = _duration_run(monkeypatch, client, dataset, pool=4, duration_s=1.0,
                           max_concurrency=3, num_warmup=0)  # fmt: skip
    assert result.summary.completed == len(result.records) > 4  # the file went round


def test_a_duration_run_of_follow_ups_only_at_an_unlimited_rate_stays_bounded(
    tmp_path, monkeypatch
):
    # One long chat: after the warm-up's first turns, every measured request follows
    # another, so none waits for a concurrency slot before it is scheduled.
    dataset = _conversations(tmp_path / "chats.jsonl", chats=1, turns=40)
    result = _duration_run(monkeypatch, _Timed(delay=0.01), dataset, pool=8, duration_s=0.3,
                           max_concurrency=2, num_warmup=2)  # fmt: skip
    # Each spec is sent again only once its last send is done: a few rounds of the
    # chain of replies fit in 0.3 s, not thousands of scheduled sends.
    assert result.summary.completed == len(result.records)
    assert 6 <= len(result.records) < 200, len(result.records)


def test_a_reply_without_text_is_not_carried_by_its_follow_up(tmp_path, monkeypatch):
    from tandem.bench.load import runner
    from tandem.client.types import GenerateChunk, Usage

    class Silent(_Timed):  # every reply's tokens decode to no text
        messages: list = []

        async def generate(self, **kwargs):
            self.messages.append(kwargs["messages"])
            yield GenerateChunk("r", "", (1,), "length", Usage(10, 1))

    monkeypatch.setattr(runner, "AsyncTandemClient", Silent(delay=0))
    dataset = _conversations(tmp_path / "chats.jsonl", chats=1, turns=2)
    config = LoadConfig(target="fake", num_requests=2, num_warmup=0, dataset=dataset,
                        progress=False)  # fmt: skip
    assert asyncio.run(run_async(config)).summary.completed == 2
    # The follow-up carries the file's text for the reply, not an empty assistant turn.
    assert Silent.messages[1][1] == {"role": "assistant", "content": "filler"}
