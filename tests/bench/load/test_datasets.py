"""Datasets: length distributions, exact synthetic prompt lengths, JSONL and ShareGPT files.

The server's tokenizer is stood in for by counters whose rules are known: byte-level
(one token per byte, like tiny-random) and one token per word, each with a BOS token.
"""

from __future__ import annotations

import asyncio
import gc
import json
import warnings

import numpy as np
import pytest

from tandem.bench.load import datasets
from tandem.bench.load.datasets import LengthDist, PromptComposer, RequestSpec
from tandem.errors import InvalidRequestError


def _text(prompt=None, messages=None) -> str:
    return prompt if prompt is not None else " ".join(m["content"] for m in messages)


async def bytes_counter(prompt=None, messages=None) -> int:
    return 1 + len(_text(prompt, messages).encode())  # BOS + one token per byte


async def words_counter(prompt=None, messages=None) -> int:
    return 1 + len(_text(prompt, messages).split())


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "spec, dist",
    [("128", LengthDist("fixed", 128)), ("fixed:7", LengthDist("fixed", 7)),
     ("uniform:10-20", LengthDist("uniform", 10, 20)),
     ("normal:100,15", LengthDist("normal", 100.0, 15.0))],
)  # fmt: skip
def test_length_specs_parse(spec, dist):
    assert LengthDist.parse(spec, "--input-len") == dist


@pytest.mark.parametrize("spec", ["", "abc", "uniform:20-10", "uniform:5", "normal:10",
                                  "poisson:3", "0", "normal:10,-1"])  # fmt: skip
def test_bad_length_specs_name_the_flag(spec):
    with pytest.raises(InvalidRequestError, match="--input-len"):
        LengthDist.parse(spec, "--input-len")


def test_length_samples_are_seeded_and_follow_the_distribution():
    uni = LengthDist("uniform", 10, 20)
    a = uni.sample(5000, np.random.default_rng(1))
    assert a == uni.sample(5000, np.random.default_rng(1))
    assert min(a) == 10 and max(a) == 20  # inclusive range
    normal = np.array(LengthDist("normal", 200, 20).sample(20000, np.random.default_rng(2)))
    assert normal.mean() == pytest.approx(200, abs=1) and normal.std() == pytest.approx(
        20, rel=0.05
    )
    assert min(LengthDist("normal", 2, 10).sample(1000, np.random.default_rng(3))) >= 1
    assert LengthDist("fixed", 9).sample(3, np.random.default_rng(0)) == [9, 9, 9]


@pytest.mark.parametrize("counter", [bytes_counter, words_counter])
def test_composed_prompts_have_the_exact_token_count(counter):
    composer = run(PromptComposer.calibrate(counter))
    assert composer.base == 1
    rng = np.random.default_rng(0)
    # Byte-level, the cheapest word costs 3 (" of"): from 4 tokens up every count is reachable.
    for n in (4, 5, 17, 64, 257):
        prompt, tokens = composer.compose(n, rng)
        assert run(counter(prompt=prompt)) == tokens == n, (n, prompt)


def test_synthetic_dataset_is_exact_repeatable_and_varied():
    inp, out = LengthDist("uniform", 20, 40), LengthDist("normal", 30, 5)
    a = run(datasets.synthetic(12, inp, out, seed=5, count=bytes_counter))
    assert a == run(datasets.synthetic(12, inp, out, seed=5, count=bytes_counter))
    assert a != run(datasets.synthetic(12, inp, out, seed=6, count=bytes_counter))
    for spec in a:
        assert run(bytes_counter(prompt=spec.prompt)) == spec.input_len
        assert 20 <= spec.input_len <= 40 and spec.output_len >= 1
    # Different words from the start: the prefix cache cannot serve one prompt from another.
    assert len({s.prompt.split()[0] + s.prompt.split()[1] for s in a}) > 6


def test_jsonl_prompts_chats_and_output_lengths(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "Once upon a time", "output_len": 7}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi there"}]}) + "\n"
    )  # fmt: skip
    specs = datasets.load_jsonl(path, default_output_len=33)
    assert specs == [
        RequestSpec(prompt="Once upon a time", output_len=7),
        RequestSpec(messages=(("user", "Hi there"),), output_len=33),
    ]
    counted = run(datasets.count_inputs(specs, words_counter))
    assert [s.input_len for s in counted] == [5, 3]


def test_jsonl_strings_may_hold_the_line_separators_json_leaves_unescaped(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 as they are; the
    # file was split at them too (str.splitlines), and the record refused as "not JSON".
    path = tmp_path / "prompts.jsonl"
    prompt = "one\u2028two\u2029three\x85four"
    path.write_bytes((json.dumps({"prompt": prompt}, ensure_ascii=False) + "\r\n").encode())
    assert datasets.load_jsonl(path, 5) == [RequestSpec(prompt=prompt, output_len=5)]


@pytest.mark.parametrize(
    "line, message",
    [("not json", "prompts.jsonl:1: not JSON"),
     ('{"prompt": ""}', 'prompts.jsonl:1: needs a non-empty "prompt"'),
     ('{"prompt": "x", "output_len": 0}', "output_len must be an integer >= 1, got 0"),
     ('{"messages": [{"content": "x"}]}', 'each message needs "role" and "content"'),
     ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}',
      'each message needs "role" and "content" strings')],
)  # fmt: skip
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InvalidRequestError, match=message):
        datasets.load_jsonl(path, 10)


def test_sharegpt_takes_the_first_human_turn_and_its_reply_length(tmp_path):
    data = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "What is a KV cache, in two sentences please?"},
            {"from": "gpt", "value": "It stores keys and values of past tokens for reuse."},
            {"from": "human", "value": "ignored"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello!"}]},
        {"id": "no reply", "conversations": [{"from": "human", "value": "Anyone there?"}]},
        {"id": "roles", "messages": [
            {"role": "user", "content": "Name four primary colours now"},
            {"role": "assistant", "content": "Red, yellow, blue, green."}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    pairs = datasets.load_sharegpt(path)
    assert len(pairs) == 3  # "no reply" has no pair
    specs = run(datasets.sharegpt(pairs, context_length=4096, count=words_counter))
    # "Hi" / "Hello!" is under 4 tokens and left out, as vLLM's benchmark does.
    assert [s.messages[0][1] for s in specs] == [pairs[0][0], pairs[2][0]]
    assert [s.output_len for s in specs] == [1 + 10, 1 + 4]
    assert specs[0].input_len == 1 + 9
    tight = run(datasets.sharegpt(pairs, context_length=16, count=words_counter))
    assert len(tight) == 1  # 10 + 11 tokens no longer fit


def test_sharegpt_chats_are_every_human_turn_with_the_history_before_it(tmp_path):
    def turn(who, text):
        return {"from": who, "value": text}

    data = [
        {"conversations": [turn("system", "be kind"), turn("human", "one two three four"),
                           turn("gpt", "five six seven eight"), turn("human", "nine ten eleven"),
                           turn("gpt", "twelve thirteen fourteen"), turn("human", "dangling")]},
        {"conversations": [turn("human", "alpha beta gamma delta"), turn("gpt", "a b c d e"),
                           turn("gpt", "out of turn"), turn("human", "never sent"),
                           turn("gpt", "x")]},
        {"conversations": [turn("human", "no reply")]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    chats = datasets.load_sharegpt_chats(path)
    assert chats == [
        [("one two three four", "five six seven eight"),
         ("nine ten eleven", "twelve thirteen fourteen")],
        [("alpha beta gamma delta", "a b c d e")],  # alternation broken after one pair
    ]  # fmt: skip
    assert datasets.load_sharegpt(path) == [chat[0] for chat in chats]
    specs = run(datasets.sharegpt_chats(chats, 10, context_length=4096, count=words_counter))
    assert [s.messages for s in specs] == [
        (("user", "one two three four"),),
        (("user", "one two three four"), ("assistant", "five six seven eight"),
         ("user", "nine ten eleven")),
        (("user", "alpha beta gamma delta"),),
    ]  # fmt: skip
    assert [(s.input_len, s.output_len) for s in specs] == [(5, 5), (12, 4), (5, 6)]
    assert datasets.follow_ups(specs) == [None, (0, 1), None]
    # Enough turns after the first chat; a turn that does not fit ends its chat.
    assert len(run(datasets.sharegpt_chats(chats, 2, 4096, words_counter))) == 2
    tight = run(datasets.sharegpt_chats(chats, 10, context_length=12, count=words_counter))
    assert [len(s.messages) for s in tight] == [1, 1]
    # --output-len: every reply that long, and a later turn's history longer by the
    # server's replies than by the file's (5 tokens more after the first turn).
    fixed = run(datasets.sharegpt_chats(chats, 10, 4096, words_counter, output_len=10))
    assert [(s.input_len, s.output_len) for s in fixed] == [(5, 10), (17, 10), (5, 10)]
    # 17 + 10 no longer fit in 26, though the file's 12 + 10 would.
    fits = run(datasets.sharegpt_chats(chats, 10, 26, words_counter, output_len=10))
    assert [len(s.messages) for s in fits] == [1, 1]


def test_pick_is_seeded_and_cycles():
    specs = [RequestSpec(prompt=str(i)) for i in range(3)]
    picked = datasets.pick(specs, 7, seed=1)
    assert picked == datasets.pick(specs, 7, seed=1)
    assert sorted(s.prompt for s in picked[:3]) == ["0", "1", "2"]
    assert picked[3:6] == picked[:3]
    # In the file's own order (multi-turn chats), cycling the same way.
    in_order = datasets.pick(specs, 5, seed=1, in_order=True)
    assert [s.prompt for s in in_order] == ["0", "1", "2", "0", "1"]


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read .*missing.jsonl"):
        datasets.load_jsonl(tmp_path / "missing.jsonl", 1)
    (tmp_path / "x.json").write_text('{"not": "a list"}')
    with pytest.raises(InvalidRequestError, match="expected a JSON list"):
        datasets.load_sharegpt(tmp_path / "x.json")


@pytest.mark.parametrize(
    "entry",
    ['"just text"', '{"conversations": "oops"}', '{"conversations": ["hi", "there"]}'],
)
def test_a_sharegpt_conversation_of_another_shape_is_named(tmp_path, entry):
    # Each ended in an AttributeError's traceback; the JSONL loader names its shapes.
    good = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
    path = tmp_path / "s.json"
    path.write_text(f"[{good}, {entry}]")
    with pytest.raises(InvalidRequestError, match=r"s.json: conversation 1 must be an object"):
        datasets.load_sharegpt_chats(path)


def test_sharegpt_turns_whose_text_is_not_a_string_are_left_out(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "yo"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    ]))  # fmt: skip
    assert datasets.load_sharegpt_chats(path) == [[("hi", "yo")]]


class _BusyRouter:
    """Tokenize as the byte counter does, but refused (Overloaded) while more than
    ``max_queue`` calls are in flight, as a router with a small max_queue is."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue, self.in_flight, self.refused = max_queue, 0, 0

    async def tokenize(self, prompt=None, messages=None) -> list[int]:
        import grpc

        from tandem.client.errors import Overloaded

        if self.in_flight >= self.max_queue:
            self.refused += 1
            raise Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "the router's queue is full")
        self.in_flight += 1
        try:
            await asyncio.sleep(0)  # the others get in meanwhile
            return [0] * (await bytes_counter(prompt, messages))
        finally:
            self.in_flight -= 1


def test_a_dataset_is_counted_through_a_router_that_takes_fewer_calls_at_once(monkeypatch, caplog):
    # 16 Tokenize calls at once failed the run against a router with max_queue 2.
    from tandem.bench.load import runner
    from tandem.client import ModelInfo

    monkeypatch.setattr(runner, "RETRY_WAIT_S", (0.001, 0.004), raising=False)

    config = runner.LoadConfig(target="-", num_requests=6, dataset=runner.DatasetConfig(
        input_len=LengthDist("fixed", 20), output_len=LengthDist("fixed", 4)))  # fmt: skip
    busy = _BusyRouter(max_queue=2)
    specs, _ = run(runner.build_dataset(busy, config, ModelInfo("m", 512, 256)))
    assert busy.refused > 0 and len(specs) == 8
    assert all(s.input_len == 20 for s in specs)
    # Said once: against a key's rate this can take minutes, with nothing else printed.
    told = [r.getMessage() for r in caplog.records if "refuses Tokenize" in r.getMessage()]
    assert len(told) == 1 and "the router's queue is full" in told[0]


def test_the_first_failure_of_a_limited_gather_leaves_no_coroutine_unawaited():
    started = []

    async def call(i: int) -> int:
        started.append(i)
        await asyncio.sleep(0.01)
        if i == 0:
            raise InvalidRequestError("prompt", "bad")
        return i

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidRequestError, match="bad"):
            run(datasets._gather_limited([call(i) for i in range(40)], limit=4))
        gc.collect()
    assert len(started) < 40
    assert not [w for w in caught if "never awaited" in str(w.message)]
