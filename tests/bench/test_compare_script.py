"""bench/compare.py: its chat workload, and one real run on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench import scripts

SCRIPT = scripts.BENCH / "compare.py"


@pytest.fixture(scope="module")
def compare():
    yield scripts.load("compare")
    scripts.unload("compare")


def test_chat_turns_repeat_their_history_in_order(compare, tmp_path):
    path = tmp_path / "chat.jsonl"
    compare.chat_dataset(path, requests=24, seed=3)
    chats = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    assert len(chats) == 4 + 24  # the warm-up first: one first turn per system prompt
    systems = [c[0]["content"] for c in chats]
    assert len(set(systems[:4])) == 4 and all(len(s.split()) > 300 for s in systems)
    assert set(systems) == set(systems[:4])
    seen: dict[str, list] = {}  # user -> its last turn's messages
    for chat in chats:
        user = chat[1]["content"].split(":")[0]
        if user in seen:  # a later turn: the earlier one is its prefix
            earlier = seen[user]
            assert chat[: len(earlier)] == earlier and len(chat) == len(earlier) + 2
        else:
            assert len(chat) == 2  # a user's first turn comes first
        seen[user] = chat
    compare.chat_dataset(tmp_path / "again.jsonl", requests=24, seed=3)
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()  # seeded


def test_the_hit_ceiling_counts_full_blocks_an_earlier_prompt_or_reply_began_with(
    compare, tmp_path
):
    from tandem.bench.load.datasets import RequestSpec

    class Chars:  # one token per character of the messages' contents
        @staticmethod
        def encode_chat(messages):
            return [ord(c) for m in messages for c in m["content"]]

    def chat(*contents, output_len=4):
        roles = ["user", "assistant", "user"]
        return RequestSpec(messages=tuple(zip(roles, contents, strict=False)),
                           output_len=output_len)  # fmt: skip

    sent = [
        chat("a" * 8),  # warm-up
        chat("a" * 8 + "b" * 7),  # 2 blocks of 4 (8 of 15 tokens)
        chat("c" * 5),  # nothing (0 of 5)
        # Follows the line before: its prompt (5) and 3 of its 4 output tokens were
        # computed, the first 2 blocks; the third holds the new user turn.
        chat("c" * 5, "r" * 4, "d" * 3, output_len=4),
    ]
    assert compare.hit_ceiling(sent, Chars, warmup=1, block_size=4) == (8 + 8) / (15 + 5 + 12)
    # Had the line before failed, its follow-up carried filler: only its prompt counts.
    failed = compare.hit_ceiling(sent, Chars, warmup=1, failed=frozenset({2}), block_size=4)
    assert failed == (8 + 4) / (15 + 5 + 12)
    # A prompt of whole blocks, all seen before, hits all but its last: the worker
    # computes the last token whatever it holds.
    again = [chat("a" * 8), chat("a" * 8)]
    assert compare.hit_ceiling(again, Chars, warmup=1, block_size=4) == 4 / 8
    # On the benchmark's own chats: a user's later turns find its earlier ones.
    path = tmp_path / "chat.jsonl"
    compare.chat_dataset(path, requests=24, seed=0)
    from tandem.bench.load.datasets import load_jsonl
    from tandem.engine.loader import resolve_model
    from tandem.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model("tiny-random"))
    assert 0.5 < compare.hit_ceiling(load_jsonl(path, 32), tokenizer, warmup=4) < 1


def test_the_hit_rate_counts_each_prompt_where_it_is_computed(compare):
    # One prompt shipped (looked up on the prefill worker, and on its decode worker
    # for the blocks not to send) and one prefilled on the decode worker.
    d = {"prefix_query_tokens": 320 + 321 + 320, "prefix_hit_tokens": 0 + 320 + 0,
         "shipped_prefix_query_tokens": 320, "shipped_prefix_hit_tokens": 0}  # fmt: skip
    assert compare._compute_hit_rate(d) == 320 / 641


def test_unknown_names_are_refused(compare, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--deployments", "colocated,bogus"])
    assert "'bogus' is not one of colocated" in capsys.readouterr().err


def test_the_unbounded_deployments_turn_the_stall_budget_off(compare):
    import argparse

    from tandem.config import DisaggregationConfig

    args = argparse.Namespace(model="tiny-random", threads=1, local_max_stall_ms=80.0)

    def budget(name):
        return compare._cluster_config(name, args).router.disaggregation.local_max_stall_ms

    assert budget("conditional-prefix") == budget("conditional") == 80.0
    assert budget("conditional-prefix-unbounded") == budget("conditional-unbounded") == 0
    args.local_max_stall_ms = None  # the config's default
    assert budget("conditional") == DisaggregationConfig().local_max_stall_ms


def test_a_deployment_takes_settings_of_the_conditional_rule(compare, capsys):
    import argparse

    args = argparse.Namespace(model="tiny-random", threads=1, local_max_stall_ms=80.0)
    spec = "conditional-2x2+prefill_queue_max=1+local_max_stall_ms=0"
    assert compare.parse_deployment(spec) == (
        "conditional-2x2",
        {"prefill_queue_max": 1, "local_max_stall_ms": 0},
    )
    config = compare._cluster_config(spec, args)
    rule = config.router.disaggregation
    assert (config.num_prefill, config.num_decode, rule.mode) == (2, 2, "conditional")
    # Its own settings win over --local-max-stall-ms and the -unbounded suffix.
    assert (rule.prefill_queue_max, rule.local_max_stall_ms) == (1, 0)
    assert compare._cluster_config("conditional-unbounded+local_max_stall_ms=50", args) \
        .router.disaggregation.local_max_stall_ms == 50  # fmt: skip
    for bad, message in [
        ("conditional+mode=always", "'mode' is not a disaggregation setting"),
        ("conditional+local_max_tokens=many", "local_max_tokens must be a number"),
        (
            "conditional+local_max_tokens=-1",
            "local_max_tokens must be a whole number >= 0, got -1\n",
        ),
        ("conditional+local_max_stall_ms=nan", "local_max_stall_ms must be finite"),
        ("bogus+local_max_tokens=1", "'bogus' is not one of colocated"),
    ]:
        with pytest.raises(SystemExit):
            compare.main(["--deployments", f"colocated,{bad}"])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_on_the_tiny_model_prints_the_table_and_writes_the_plot(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-random", "--deployments",
         "colocated-prefix,conditional", "--workloads", "chat", "--rates", "8",
         "--requests", "6", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    rows = {r["deployment"]: r for r in data["rows"]}
    assert set(rows) == {"colocated-prefix", "conditional"}
    for r in rows.values():
        assert r["completed"] == 6 and r["failed"] == 0 and r["workload"] == "chat"
        assert 0 < r["hit_rate"] <= 1  # later turns find their history cached
    colocated, conditional = rows["colocated-prefix"], rows["conditional"]
    assert colocated["local"] == 1 and colocated["kv_mib_per_request"] == 0
    assert conditional["kv_mib_per_request"] > 0  # chat prompts are long: shipped
    assert (out / "compare.json").exists() and (out / "slo_attainment.png").stat().st_size > 0
