"""deploy/grafana/tandem-dashboard.json and deploy/prometheus.yml against the metric list.

The dashboard may only name metrics that ``METRICS`` lists: counters and gauges by
their scraped name, histograms by one of their series (``_bucket``, ``_sum``,
``_count``). ``dashboard_metric_names()`` is also used by tests/e2e to check the
dashboard's names against a real scrape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tandem.deploy.ray_cluster.config import RayDeployConfig
from tandem.metrics import METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tandem-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus.yml"

_NAME = re.compile(r"tandem_[a-z0-9_]+")
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
_HISTOGRAMS = {m.name for m in METRICS if m.type == "histogram"}
_SERIES = {m.name for m in METRICS if m.type != "histogram"}  # counters and gauges


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data: rows are skipped, a collapsed row's panels included."""
    found = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL query: the panels' ``expr`` and the template variables' queries."""
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs + variables


def _base_name(series: str) -> str:
    """A scraped series' metric name: a histogram's ``_bucket``/``_sum``/``_count`` stripped."""
    for suffix in _HISTOGRAM_SERIES:
        if series.endswith(suffix) and series.removesuffix(suffix) in _HISTOGRAMS:
            return series.removesuffix(suffix)
    return series


def _referenced_series(dashboard: dict) -> set[str]:
    return {name for query in _queries(dashboard) for name in _NAME.findall(query)}


def dashboard_metric_names() -> set[str]:
    """The metric names the dashboard queries (histograms by their base name)."""
    return {_base_name(s) for s in _referenced_series(load_dashboard())}


def test_every_panel_has_a_title_and_queries():
    dashboard = load_dashboard()
    panels = _panels(dashboard)
    assert len(panels) >= 20
    for panel in panels:
        assert panel.get("title"), panel
        assert panel.get("targets"), f"{panel['title']}: no targets"
        for target in panel["targets"]:
            assert target.get("expr"), f"{panel['title']}: target {target} has no expr"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"


def test_panel_ids_are_unique():
    dashboard = load_dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    ids += [p["id"] for row in dashboard["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids))


def test_template_variables():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # $model must have a value on a router that has served nothing yet: every panel
    # filters on it, and tandem_router_requests_total has no series before a request
    # ends, so a fresh deployment's dashboard showed nothing.
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tandem.metrics.export import RouterMetrics

    source = re.fullmatch(r"label_values\((\w+), model\)", variables["model"]["definition"])
    fresh = generate_latest(RouterMetrics("m").registry).decode()
    samples = [s for f in text_string_to_metric_families(fresh) for s in f.samples]
    assert any(s.name == source[1] and s.labels.get("model") == "m" for s in samples)
    worker = variables["worker"]
    assert "tandem_worker_kv_blocks_capacity" in worker["definition"]
    assert worker["multi"] and worker["includeAll"]


def test_dashboard_names_only_listed_metrics():
    series = _referenced_series(load_dashboard())
    for name in sorted(series):
        base = _base_name(name)
        if base in _HISTOGRAMS:
            # a histogram has no series of its own name: only _bucket, _sum, _count
            assert name != base, f"{name} is a histogram: query {name}_bucket, _sum or _count"
        else:
            assert name in _SERIES, f"{name} is not in tandem.metrics.METRICS"


def test_dashboard_metric_names_are_base_names():
    names = dashboard_metric_names()
    assert "tandem_router_time_to_first_token_seconds" in names
    assert "tandem_worker_kv_usage_ratio" in names
    assert names <= _HISTOGRAMS | _SERIES
    assert not any(n.endswith(("_bucket", "_sum", "_count")) for n in names)


def test_base_name_strips_only_histogram_series():
    assert _base_name("tandem_worker_step_seconds_bucket") == "tandem_worker_step_seconds"
    assert _base_name("tandem_worker_batch_size_sum") == "tandem_worker_batch_size"
    # not a histogram: left alone, so the check above reports it
    assert _base_name("tandem_worker_kv_blocks_count") == "tandem_worker_kv_blocks_count"


def test_prometheus_config_scrapes_the_launchers_targets():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    files = {
        name: [f for sd in job.get("file_sd_configs", []) for f in sd["files"]]
        for name, job in jobs.items()
    }
    assert any(f.endswith("/prometheus-targets.json") for f in files["tandem-local"])
    ray_default = Path(RayDeployConfig().targets_file).name  # what the controller writes
    assert any(f.endswith(ray_default) for f in files["tandem-ray"])
    assert any(job.get("static_configs") for job in jobs.values())
    for job in jobs.values():
        # the file_sd `role` label must not rename the router's own `role` label
        assert job.get("honor_labels") is True, job["job_name"]
