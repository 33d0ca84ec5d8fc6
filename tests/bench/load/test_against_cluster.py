"""Short runs against a real local cluster (tiny-random, 1 prefill + 1 decode worker)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re

import pytest

from tandem.bench.load import sweep
from tandem.cli import main
from tandem.config import EngineConfig
from tandem.deploy.local import ClusterConfig, LocalCluster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = ClusterConfig(
        engine=EngineConfig(model="tiny-random", num_blocks=256),
        threads_per_worker=1,
        metrics=True,
    )
    router = dataclasses.replace(config.router, port=0, http_port=0)
    config = dataclasses.replace(config, router=router)
    with LocalCluster(config, tmp_path_factory.mktemp("loadtest")) as c:
        yield c


def _assert_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def _ordered(stats: dict) -> bool:
    return stats["median"] <= stats["p90"] <= stats["p99"]


def test_a_short_load_writes_consistent_outputs(cluster, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["bench", "load", "--target", cluster.address, "--num-requests", "12",
            "--request-rate", "40", "--burstiness", "0.5", "--max-concurrency", "4",
            "--input-len", "uniform:16-48", "--output-len", "uniform:4-12", "--seed", "3",
            "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000", "--out", str(out),
            "--metrics", cluster.metrics_targets()["router"]]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "12 completed, 0 failed" in table and "SLO attainment 100.0%" in table
    # The router counted the same run, between its before and after scrapes.
    assert re.search(r"^server: 12 ok, 0 failed, (\d+) output tokens; TTFT p50", table, re.M)
    assert re.search(r"^client: 12 ok, 0 failed, (\d+) output tokens", table, re.M)
    server, client = (re.search(rf"^{w}: .*?, (\d+) output tokens", table, re.M).group(1)
                      for w in ("server", "client"))  # fmt: skip
    assert server == client
    # Each decode worker's steps: how many sequences they held, and what was preempted.
    assert re.search(r"^decode decode-\S+: \d+\.\d sequences a step on average, p99 \d+ "
                     r"\(histogram\), 0 preempted$", table, re.M), table  # fmt: skip
    # Where the router had the run's prompts prefilled, and why.
    assert re.search(r"^prefilled: on the prefill pool 12 \(always 12\)$", table, re.M), table
    # Each worker whose prefix cache was looked up: its hit rate over the run (the
    # prefill worker looks up every prompt).
    hits = re.findall(r"^prefix cache, (\w+) \S+: (\d+\.\d)% hit \((\d+) of (\d+) prompt "
                      r"tokens looked up\)$", table, re.M)  # fmt: skip
    assert "prefill" in {role for role, *_ in hits}, table
    for _, pct, hit, looked in hits:
        assert 0 <= int(hit) <= int(looked) and abs(float(pct) - 100 * int(hit) / int(looked)) < 0.1
    for when in ("before", "after"):
        saved = sorted(p.name for p in (out / "server-metrics" / when).iterdir())
        assert len(saved) == 3 and "router.prom" in saved, saved  # and both workers
        assert "tandem_router_requests_in_flight" in (out / "server-metrics" / when /
                                                     "router.prom").read_text()  # fmt: skip

    summary = json.loads((out / "summary.json").read_text())
    s = summary["summary"]
    assert (s["num_requests"], s["completed"], s["failed"], s["errors"]) == (12, 12, 0, {})
    assert summary["model"]["model_id"] == "tiny-random"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert _ordered(s[key]), (key, s[key])
    assert s["ttft_ms"]["median"] <= s["e2e_ms"]["median"]
    assert 1 <= s["max_concurrency_seen"] <= 4
    assert s["good_requests"] == 12 and s["goodput"] == pytest.approx(s["request_throughput"])

    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 12 and [int(r["index"]) for r in rows] == list(range(12))
    for r in rows:
        # Synthetic prompts have exactly the drawn length in the server's tokens, and
        # max_tokens with ignore_eos gives exactly the drawn output length.
        assert r["input_len"] == r["prompt_tokens"] and 16 <= int(r["prompt_tokens"]) <= 48
        assert r["output_len"] == r["output_tokens"] and 4 <= int(r["output_tokens"]) <= 12
        assert r["finish_reason"] == "length" and r["met_slo"] == "1"
    assert sum(int(r["output_tokens"]) for r in rows) == s["output_tokens"]
    assert sum(int(r["prompt_tokens"]) for r in rows) == s["input_tokens"]
    send_times = [float(r["send_time_s"]) for r in rows]
    assert send_times == sorted(send_times)
    for name in ("latency_cdf.png", "token_timeline.png"):
        _assert_png(out / name)


def test_failed_requests_are_counted_by_grpc_status(cluster, tmp_path, capsys):
    # 8 + 3000 tokens reserve 188 of the decode worker's 256 blocks: the first request
    # runs into its 0.3 s deadline, the others find no room (RESOURCE_EXHAUSTED).
    argv = ["bench", "load", "--target", cluster.address, "--num-requests", "3",
            "--num-warmup", "0", "--input-len", "8", "--output-len", "3000",
            "--timeout", "0.3", "--quiet", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 1  # no request completed: the table and files all the same
    table = capsys.readouterr().out
    s = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert (s["completed"], s["failed"], s["slo_attainment"]) == (0, 3, 0)
    assert sum(s["errors"].values()) == 3 and s["errors"]["DEADLINE_EXCEEDED"] >= 1
    assert set(s["errors"]) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert "errors       DEADLINE_EXCEEDED" in table, table
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert sorted(r["error"] for r in rows) == sorted(
        code for code, n in s["errors"].items() for _ in range(n)
    )


def test_a_jsonl_dataset_runs_for_a_duration(cluster, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Once upon a time", "output_len": 5}\n'
                    '{"messages": [{"role": "user", "content": "Hi"}]}\n')  # fmt: skip
    argv = ["bench", "load", "--target", cluster.address, "--dataset", "jsonl",
            "--dataset-path", str(data), "--output-len", "6", "--duration", "1",
            "--request-rate", "8", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "run" / "requests.csv").open()))
    assert 2 <= len(rows) <= 30 and all(float(r["send_time_s"]) < 1.0 for r in rows)
    assert {r["output_tokens"] for r in rows} <= {"5", "6"}


def test_an_out_that_cannot_be_a_directory_is_refused_before_any_request(tmp_path, capsys):
    # Found only when the results were written: the whole run was lost.
    taken = tmp_path / "a-file"
    taken.write_text("")
    for command in ("load", "sweep"):
        rates = ["--request-rates", "1"] if command == "sweep" else []
        argv = ["bench", command, "--target", "127.0.0.1:1", "--num-requests", "2",
                "--out", str(taken), *rates]  # fmt: skip
        assert main(argv) == 2
        assert f"--out {taken}: File exists" in capsys.readouterr().err


@pytest.mark.parametrize("gone_after", [2, 1], ids=["after the run", "after the warm-up"])
def test_results_are_written_when_the_server_metrics_go_away(
    cluster, tmp_path, monkeypatch, gone_after
):
    # Gone after the warm-up, the run was aborted with exit 2 and nothing written.
    from tandem.bench.load import server_metrics
    from tandem.metrics.scrape import ScrapeError

    scrapes = []

    def snapshot(address):
        scrapes.append(address)
        if len(scrapes) > gone_after:  # 1: before the run, 2: after the warm-up
            raise ScrapeError("cannot scrape: gone")
        return {"router": ""}

    monkeypatch.setattr(server_metrics, "snapshot", snapshot)
    argv = ["bench", "load", "--target", cluster.address, "--num-requests", "2",
            "--input-len", "8", "--output-len", "2", "--quiet", "--metrics", "127.0.0.1:1",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    assert (tmp_path / "run" / "summary.json").exists()
    assert len(scrapes) == gone_after + 1  # none after the run without one before it


def test_a_two_point_sweep_finds_the_capacity(cluster, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["bench", "sweep", "--target", cluster.address, "--request-rates", "20,5",
            "--num-requests", "6", "--num-warmup", "1", "--input-len", "16",
            "--output-len", "4", "--slo-ttft-ms", "20000", "--decode-workers", "1",
            "--quiet", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "sweep.json").read_text())
    assert [p["x"] for p in data["points"]] == [5, 20]  # sorted
    assert [p["summary"]["completed"] for p in data["points"]] == [6, 6]
    # What the 20 req/s point kept up with, at most its offered rate.
    capacity = min(20, data["points"][1]["summary"]["completion_rate"])
    assert (data["capacity_point"], data["capacity_rps"]) == (1, capacity)
    assert f"capacity: {capacity:.3g} req/s" in printed
    assert data["deployment"] == {"prefill_workers": 1, "decode_workers": 1}
    for name in (sweep.LATENCY_PLOT, sweep.ATTAINMENT_PLOT, "request_rate-5/latency_cdf.png"):
        _assert_png(out / name)
    assert main(["plan", "--model", "tiny-random", "--sweep", str(out / "sweep.json"),
                 "--target-rate", "50"]) == 0  # fmt: skip
    n = math.ceil(50 / capacity)
    assert f"plan: {n} prefill + {n} decode workers for 50 req/s" in capsys.readouterr().out


def test_capacity_stops_at_the_first_point_below_target():
    def point(x, attained):
        return {"x": x, "summary": {"slo_attainment": attained}}

    points = [point(1, 1.0), point(2, 0.95), point(4, 0.5), point(8, 0.92)]
    assert sweep.capacity_index(points, 0.9) == 1  # 8 req/s recovering does not count
    assert sweep.capacity_index(points[2:], 0.9) is None
    assert sweep.capacity_index([point(1, None)], 0.9) is None


def test_the_openai_api_and_grpc_measure_the_same_run_alike(cluster, tmp_path, capsys):
    """One harness, two APIs of one cluster: the same requests, tokens and SLO count."""
    common = ["--num-requests", "8", "--max-concurrency", "2", "--input-len", "uniform:16-40",
              "--output-len", "6", "--seed", "5", "--quiet"]  # fmt: skip
    summaries = {}
    for api, target in (("grpc", cluster.address), ("openai", f"http://{cluster.http_address}")):
        out = tmp_path / api
        assert main(["bench", "load", "--api", api, "--target", target, *common,
                     "--out", str(out)]) == 0  # fmt: skip
        summaries[api] = json.loads((out / "summary.json").read_text())["summary"]
    capsys.readouterr()
    grpc_s, http_s = summaries["grpc"], summaries["openai"]
    for key in ("num_requests", "completed", "failed", "input_tokens", "output_tokens"):
        assert grpc_s[key] == http_s[key], key
    assert http_s["completed"] == 8 and http_s["output_tokens"] == 48
    assert http_s["ttft_ms"]["median"] > 0 and http_s["itl_ms"]["median"] > 0


def test_without_a_tokenize_endpoint_prompts_are_counted_by_usage(cluster):
    import asyncio

    from tandem.bench.load.openai_api import OpenAIClient

    async def counts():
        async with OpenAIClient(cluster.http_address) as client:
            info = await client.model_info()
            fast = await client.tokenize(prompt="hello there, general")
            client._tokenize_endpoint = False  # as against a server with no /tokenize
            slow = await client.tokenize(prompt="hello there, general")
            return info, len(fast), len(slow)

    info, fast, slow = asyncio.run(counts())
    assert info.model_id == "tiny-random" and info.context_length > 1000
    assert fast == slow > 0
