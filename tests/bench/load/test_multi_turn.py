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


def test_multi_turn_is_for_files_of_chats():
    with pytest.raises(InvalidRequestError, match="--multi-turn is for jsonl and sharegpt"):
        DatasetConfig(multi_turn=True)


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


def test_a_follow_up_of_a_failed_turn_carries_the_files_text_and_cycles_wait_anew():
    from tandem.bench.load.runner import _Turns

    first = _chat(("user", "1"))
    second = _chat(("user", "1"), ("assistant", "filler"), ("user", "2"))

    async def scenario():
        turns = _Turns([first, second], multi_turn=True)
        turns.start(0)
        turns.done(0, None)  # the first turn failed
        turns.start(1)
        assert (await turns.ready(1)).messages == second.messages
        turns.start(0)  # the file cycled: the next send of 1 waits for this reply
        waiting = asyncio.ensure_future(turns.ready(1))
        await asyncio.sleep(0)
        assert not waiting.done()
        turns.done(0, "a real reply")
        assert (await waiting).messages[1] == ("assistant", "a real reply")

    asyncio.run(scenario())


def test_a_sharegpt_conversation_is_replayed_turn_by_turn_with_the_servers_replies(
    frontend, tmp_path  # noqa: F811
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
