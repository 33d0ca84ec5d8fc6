"""``tandem top``'s frame from scripted scrapes: rates between polls, the window, gaps."""

from __future__ import annotations

import json

from tandem.metrics import top
from tandem.metrics.scrape import Sample, ScrapeError


def _router(ok: float, ttft: dict[float, float]) -> list[Sample]:
    samples = [
        Sample("tandem_router_requests_total", {"code": "OK"}, ok),
        Sample("tandem_router_requests_total", {"code": "UNAVAILABLE"}, 1),
        Sample("tandem_router_requests_in_flight", {"model": "m"}, 2),
        Sample("tandem_router_worker_up", {"worker": "h:1", "role": "decode"}, 1),
        Sample(
            "tandem_router_worker_info",
            {
                "worker": "h:1",
                "role": "decode",
                "worker_id": "decode-h:1",
                "metrics_address": "h:91",
            },
            1,
        ),  # fmt: skip
        Sample(
            "tandem_router_worker_info",
            {
                "worker": "h:2",
                "role": "prefill",
                "worker_id": "prefill-h:2",
                "metrics_address": "h:92",
            },
            1,
        ),  # fmt: skip
    ]
    samples += [Sample("tandem_router_time_to_first_token_seconds_bucket",
                       {"le": str(le)}, n) for le, n in ttft.items()]  # fmt: skip
    return samples


def _decode(tokens: float) -> list[Sample]:
    labels = {"worker": "decode-h:1", "role": "decode", "model": "m"}
    return [
        Sample("tandem_worker_kv_blocks_used", labels, 25),
        Sample("tandem_worker_kv_blocks_capacity", labels, 100),
        Sample("tandem_worker_tensor_parallel_ranks", labels, 2),
        Sample("tandem_worker_queue_depth", labels, 3),
        Sample("tandem_worker_running_requests", labels, 4),
        Sample("tandem_worker_decode_step_seconds", labels, 0.0456),
        Sample("tandem_worker_generated_tokens_total", labels, tokens),
        Sample("tandem_worker_prefix_cache_query_tokens_total", labels, 200),
        Sample("tandem_worker_prefix_cache_hit_tokens_total", labels, 150),
    ]


def _frame(monkeypatch, polls: list[dict], seconds: float) -> str:
    """The frame after two polls ``seconds`` apart, each scrape answered from ``polls``
    (a process missing from one is refused)."""
    polls, current = iter(polls), {}

    def fake_scrape(address, timeout=5.0):
        if address == "r:9":
            current.update(next(polls))
        if address not in current:
            raise ScrapeError(f"cannot scrape http://{address}/metrics: refused")
        return current[address]

    monkeypatch.setattr(top, "scrape", fake_scrape)
    view = top.ClusterView("r:9")
    view.poll(now=100.0)
    view.poll(now=100.0 + seconds)
    return view.render()


def test_a_frame_shows_rates_between_polls_and_latency_within_the_window(monkeypatch):
    frame = _frame(monkeypatch, [
        {"r:9": _router(10, {0.1: 0, 1.0: 0, float("inf"): 0}), "h:91": _decode(100)},
        {"r:9": _router(30, {0.1: 10, 1.0: 20, float("inf"): 20}), "h:91": _decode(300)},
    ], seconds=2.0)  # fmt: skip
    # The window's requests: 20 of them, all ok (30 since start).
    assert "requests  2 in flight  10.00 req/s  20 ok  0 errors (last 2 s)" in frame
    # 20 requests in the window: p50 at rank 10 is the first bucket's bound.
    assert "TTFT p50 100 ms p99 982 ms" in frame, frame
    (row,) = [line for line in frame.splitlines() if line.startswith("decode-h:1")]
    assert row.split()[1:7] == ["decode", "2", "1", "3", "4", "46ms"]  # 2 ranks, up
    assert "[##........]  25%" in row and "100.0" in row and "75%" in row  # 200 tok / 2 s
    assert "h:92" in frame and "unreachable" in frame and "! cannot scrape http://h:92" in frame


def test_the_targets_file_names_the_router_and_the_workers(tmp_path, monkeypatch):
    path = tmp_path / "targets.json"
    path.write_text(json.dumps([
        {"targets": ["r:9"], "labels": {"process": "router", "role": "router"}},
        {"targets": ["h:91"], "labels": {"process": "decode-0", "role": "decode"}},
    ]))  # fmt: skip
    monkeypatch.setattr(top, "scrape", lambda address, timeout=5.0: (
        _router(1, {float("inf"): 1}) if address == "r:9" else _decode(5)))  # fmt: skip
    view = top.ClusterView(targets_file=path)
    view.poll(now=1.0)
    frame = view.render()
    assert "router metrics r:9" in frame
    assert list(view.polls[-1].workers) == ["h:91"]  # the file's workers, not the router's


def test_a_counter_that_went_back_is_a_restart_not_a_negative_rate(monkeypatch):
    # A worker restarted on the same metrics address: its counters start again from 0,
    # and the frame read -49880 tok/s.
    frame = _frame(monkeypatch, [
        {"r:9": _router(30, {float("inf"): 0}), "h:91": _decode(50_000)},
        {"r:9": _router(4, {float("inf"): 0}), "h:91": _decode(120)},
    ], seconds=1.0)  # fmt: skip
    assert "requests  2 in flight  5.00 req/s  4 ok  1 errors (last 1 s)" in frame, frame
    (row,) = [line for line in frame.splitlines() if line.startswith("decode-h:1")]
    assert " 120.0 " in row and "-49880" not in row
