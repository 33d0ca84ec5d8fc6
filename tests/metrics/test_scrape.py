"""Parsing and histogram quantiles, checked against what PromQL computes."""

from __future__ import annotations

import math

import pytest

from tandem.metrics.scrape import buckets, delta, parse, quantile, total, worker_targets

TEXT = """\
# HELP t_seconds A histogram.
# TYPE t_seconds histogram
t_seconds_bucket{le="0.1",model="m"} 2.0
t_seconds_bucket{le="0.5",model="m"} 6.0
t_seconds_bucket{le="1.0",model="m"} 10.0
t_seconds_bucket{le="+Inf",model="m"} 10.0
t_seconds_count{model="m"} 10.0
t_seconds_sum{model="m"} 4.2
# HELP c_total A counter.
# TYPE c_total counter
c_total{code="OK"} 3.0
c_total{code="UNAVAILABLE"} 1.0
# HELP tandem_router_worker_info Info.
# TYPE tandem_router_worker_info gauge
tandem_router_worker_info{metrics_address="h:9",role="decode",worker="h:1",worker_id="d"} 1.0
tandem_router_worker_info{metrics_address="",role="prefill",worker="h:2",worker_id="p"} 1.0
"""


def test_totals_filter_by_labels():
    samples = parse(TEXT)
    assert total(samples, "c_total") == 4 and total(samples, "c_total", code="OK") == 3
    assert total(samples, "c_total", code="CANCELLED") == 0


def test_quantiles_interpolate_within_the_bucket_as_histogram_quantile_does():
    counts = buckets(parse(TEXT), "t_seconds", model="m")
    assert counts == {0.1: 2, 0.5: 6, 1.0: 10, math.inf: 10}
    # rank 5 of 10 lies in (0.1, 0.5], 3 of its 4: 0.1 + 0.4 * 3/4.
    assert quantile(0.5, counts) == pytest.approx(0.4)
    assert quantile(0.1, counts) == pytest.approx(0.05)  # the first bucket starts at 0
    assert quantile(0.99, counts) == pytest.approx(0.5 + 0.5 * 3.9 / 4)


def test_a_quantile_in_the_inf_bucket_is_the_largest_finite_bound_and_none_without_data():
    assert quantile(0.99, {0.1: 1, 1.0: 1, math.inf: 5}) == 1.0
    assert quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert quantile(0.5, {}) is None


def test_delta_is_what_was_observed_between_two_scrapes():
    before = {0.1: 2, 0.5: 6, math.inf: 6}
    after = {0.1: 2, 0.5: 9, math.inf: 10}
    assert delta(after, before) == {0.1: 0, 0.5: 3, math.inf: 4}


def test_worker_targets_are_the_workers_that_serve_metrics():
    targets = worker_targets(parse(TEXT))
    assert list(targets) == ["h:9"] and targets["h:9"].labels["worker_id"] == "d"


@pytest.mark.parametrize("answer", [b"\x00\x00\x12\x04garbage", b"HTTP/1.0 200 OK\r\n\r\n<html>"])
def test_an_endpoint_that_is_not_a_metrics_port_is_named_not_a_traceback(answer):
    # A router's gRPC port (another protocol) or a web page: easy to mistake for the
    # metrics address, and each escaped as a raw traceback (tandem top, bench load).
    import socket
    import threading

    from tandem.metrics.scrape import ScrapeError, fetch

    server = socket.create_server(("127.0.0.1", 0))

    def answer_once():
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=answer_once, daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    with pytest.raises(ScrapeError, match=r"cannot scrape .* \(is it a metrics port\?\)"):
        fetch(address)
    server.close()
