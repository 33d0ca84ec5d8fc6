"""Metric arithmetic on hand-made timelines (times in seconds after each request was sent)."""

from __future__ import annotations

import math

import pytest

from tandem.bench.load.metrics import SLO, RequestRecord, Stats, max_in_flight, summarize


def rec(index=0, send=0.0, times=(), tokens=None, prompt=10, error=None, finish="length"):
    tokens = list(tokens) if tokens is not None else [1] * len(times)
    return RequestRecord(
        index, send, prompt, sum(tokens), list(times), tokens, prompt_tokens=prompt,
        output_tokens=sum(tokens), finish_reason=None if error else finish, error=error,
    )  # fmt: skip


def test_ttft_tpot_and_itl_of_one_request():
    # 5 tokens in 4 responses; the third carries 2 tokens.
    r = rec(times=[0.100, 0.150, 0.250, 0.300], tokens=[1, 1, 2, 1])
    assert r.ttft == pytest.approx(0.100)
    assert r.e2e == pytest.approx(0.300)
    assert r.tpot == pytest.approx((0.300 - 0.100) / (5 - 1))  # 50 ms
    assert r.itls == pytest.approx([0.050, 0.100, 0.050])  # one gap per response


def test_a_last_response_without_tokens_ends_e2e_but_adds_no_itl():
    r = rec(times=[0.1, 0.2, 0.21], tokens=[1, 1, 0])
    assert r.itls == pytest.approx([0.1])
    assert r.e2e == pytest.approx(0.21)
    assert r.tpot == pytest.approx((0.21 - 0.1) / 1)


def test_one_token_output_has_no_tpot_and_a_failed_request_has_no_timings():
    assert rec(times=[0.05]).tpot is None
    failed = rec(times=[0.1, 0.2], error="UNAVAILABLE")
    assert (failed.ok, failed.ttft, failed.e2e, failed.tpot, failed.itls) == (
        False, None, None, None, [],
    )  # fmt: skip


def test_summary_throughput_goodput_and_attainment():
    records = [
        rec(0, 0.0, [0.100, 0.150, 0.250, 0.300], [1, 1, 2, 1], prompt=10),  # TPOT 50 ms
        rec(1, 0.5, [0.300, 0.310, 0.320], prompt=20),  # TTFT 300 ms, TPOT 10 ms
        rec(2, 0.7, [], error="UNAVAILABLE"),
        rec(3, 1.0, [0.050], prompt=30),  # one token: TPOT not defined, counts as met
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=40))
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert s.errors == {"UNAVAILABLE": 1}
    assert (s.input_tokens, s.output_tokens) == (60, 5 + 3 + 1)
    assert s.request_throughput == pytest.approx(3 / 2.0)
    assert s.output_throughput == pytest.approx(9 / 2.0)
    assert s.total_token_throughput == pytest.approx(69 / 2.0)
    # Only request 3 meets both SLOs: 0 misses TPOT, 1 misses TTFT, 2 failed.
    assert s.good_requests == 1
    assert s.goodput == pytest.approx(1 / 2.0)
    assert s.slo_attainment == pytest.approx(1 / 4)
    # TTFTs 100, 300, 50 ms; numpy's linear interpolation: p90 = 100 + 0.8 x 200.
    assert s.ttft_ms == Stats(mean=150.0, median=100.0, p90=260.0, p99=296.0)
    assert s.tpot_ms.mean == pytest.approx(30.0)  # (50 + 10) / 2
    assert s.itl_ms.mean == pytest.approx((50 + 100 + 50 + 10 + 10) / 5)
    assert s.e2e_ms.median == pytest.approx(300.0)
    assert s.max_concurrency_seen == 1  # [0, 0.3], [0.5, 0.82], [1.0, 1.05] do not overlap


def test_max_in_flight_counts_overlapping_requests():
    records = [rec(0, 0.0, [1.0]), rec(1, 0.5, [1.0]), rec(2, 0.9, [0.05]), rec(3, 2.0, [0.1])]
    assert max_in_flight(records) == 3  # at 0.9 s requests 0, 1 and 2 are open
    back_to_back = [rec(0, 0.0, [1.0]), rec(1, 1.0, [1.0])]
    assert max_in_flight(back_to_back) == 1
    # Requests that failed with no response were open too (a frozen worker's streams).
    stuck = [_ended(i, 0.1 * i, 2.6, error="DEADLINE_EXCEEDED") for i in range(3)]
    assert max_in_flight(stuck) == 3


def test_the_completion_rate_leaves_out_the_runs_ramp_up_and_drain():
    from tandem.bench.load.metrics import completion_rate

    # One request a second, each done 5.9 s after it was sent: completions 1 s apart.
    done = [rec(i, float(i), [5.9]) for i in range(24)]
    assert completion_rate(done) == pytest.approx(1.0)
    assert summarize(done, 28.9, SLO()).request_throughput == pytest.approx(24 / 28.9)
    assert math.isnan(completion_rate(done[:1]))


def test_without_slos_goodput_is_the_completed_rate():
    records = [rec(0, 0.0, [0.1, 0.2]), rec(1, 0.0, [], error="DEADLINE_EXCEEDED")]
    s = summarize(records, 4.0, SLO())
    assert (s.good_requests, s.goodput, s.slo_attainment) == (1, 0.25, 0.5)


def test_empty_measurements_are_nan_not_errors():
    s = summarize([rec(0, 0.0, [], error="UNAVAILABLE")], 1.0, SLO(ttft_ms=10))
    assert math.isnan(s.ttft_ms.median) and math.isnan(s.tpot_ms.p99)
    assert s.slo_attainment == 0.0


def _ended(index, send, end, error=None):
    r = rec(index, send, times=[] if error else [end], error=error)
    r.end_time = end
    return r


def test_a_failure_storm_is_reported_as_a_burst_with_its_span():
    # 20 requests complete, then from t=10 s every request fails fast with UNAVAILABLE.
    records = [_ended(i, i * 0.5, 1.0) for i in range(20)]
    records += [_ended(20 + i, 10 + i * 0.1, 0.01, "UNAVAILABLE") for i in range(30)]
    records.append(_ended(50, 12.0, 0.02, "DEADLINE_EXCEEDED"))  # one of another kind
    (burst,) = summarize(records, 13.0, SLO()).bursts
    # Inside the span: the 30 failures, one late completion and the other failure.
    assert (burst.status, burst.failed, burst.ended) == ("UNAVAILABLE", 30, 32)
    assert burst.start_s == pytest.approx(10.01) and burst.end_s == pytest.approx(12.91)
    assert "failure burst, not capacity" in burst.describe()


def test_failures_spread_over_a_healthy_run_are_no_burst():
    records = []
    for i in range(60):  # every sixth request fails, evenly
        records.append(_ended(i, i * 0.2, 0.5, "RESOURCE_EXHAUSTED" if i % 6 == 0 else None))
    assert summarize(records, 13.0, SLO()).bursts == []


def test_the_server_side_report_says_where_the_runs_prompts_were_prefilled_and_why():
    from tandem.bench.load.server_metrics import _decisions
    from tandem.metrics.scrape import parse

    name = "tandem_router_prefill_decisions_total"

    def text(**counts):  # where__reason=count
        lines = []
        for key, n in counts.items():
            where, reason = key.split("__")
            lines.append(f'{name}{{where="{where}",reason="{reason}"}} {n}\n')
        return "".join(lines)

    before = parse(text(decode_worker__short=3, prefill_pool__long=1))
    after = parse(text(decode_worker__short=13, decode_worker__prefill_busy=4,
                       prefill_pool__long=3, prefill_pool__decode_busy=1))  # fmt: skip
    assert _decisions(after, before) == [
        "prefilled: on the decode worker 14 (short 10, prefill busy 4); "
        "on the prefill pool 3 (long 2, decode busy 1)"
    ]
    assert _decisions(before, before) == []  # nothing decided during the run: no line


def test_a_worker_that_does_not_answer_is_left_out_of_the_servers_view(monkeypatch, caplog):
    # The router lists a dead worker until it is removed: its failed scrape refused the
    # whole run (exit 2), or dropped the server's view of it, the router's included.
    from tandem.bench.load import server_metrics
    from tandem.metrics.scrape import ScrapeError

    info = ('tandem_router_worker_info{{metrics_address="{0}",role="decode",'
            'worker="{0}",worker_id="{1}"}} 1.0\n')  # fmt: skip
    router = (
        "# TYPE tandem_router_worker_info gauge\n"
        + info.format("h:1", "decode-0")
        + info.format("h:2", "decode-1")
        + 'tandem_router_requests_total{code="OK"} 3\n'
    )
    texts = {"r:9": router, "h:1": 'tandem_worker_batch_size_count{role="decode"} 4\n'}

    def fetch(address):
        if address not in texts:
            raise ScrapeError(f"cannot scrape http://{address}/metrics: refused")
        return texts[address]

    monkeypatch.setattr(server_metrics, "fetch", fetch)
    before = server_metrics.snapshot("r:9")
    assert sorted(before) == ["decode-0", "router"]
    assert "worker decode-1's metrics left out" in caplog.text
    del texts["h:1"]  # decode-0 dies during the run
    texts["h:2"] = ""  # and decode-1 comes back
    after = server_metrics.snapshot("r:9")
    summary = summarize([], 1.0, SLO())
    lines = server_metrics.compare(before, after, summary).splitlines()
    assert lines[-1] == ("workers scraped only before or only after the run (left out): "
                         "decode-0, decode-1")  # fmt: skip


class _Refusing:
    """A client whose router refuses every request, as one refuses a bad setting."""

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
        import grpc

        from tandem.client.errors import InvalidRequest

        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "top_k must be >= 0, got -1")
        yield  # an async generator, as the client's


def test_the_report_says_what_the_server_said_for_each_kind_of_failure(monkeypatch, tmp_path):
    # It said only "errors INVALID_ARGUMENT 3": why every request failed was not in it.
    import asyncio

    from tandem.bench.load import report, runner

    monkeypatch.setattr(runner, "AsyncTandemClient", _Refusing())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "output_len": 1}\n' * 3)
    dataset = runner.DatasetConfig(kind="jsonl", path=str(prompts))
    config = runner.LoadConfig(
        target="fake", num_requests=3, num_warmup=0, dataset=dataset, progress=False
    )
    result = asyncio.run(runner.run_async(config))
    assert result.summary.errors == {"INVALID_ARGUMENT": 3}
    assert result.summary.error_details == {"INVALID_ARGUMENT": "top_k must be >= 0, got -1"}
    assert "INVALID_ARGUMENT (first): top_k must be >= 0, got -1" in report.table(result)
