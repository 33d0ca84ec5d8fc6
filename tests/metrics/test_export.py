"""The metric list: the code, the README's table and the registries agree."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest

from tandem.metrics import METRICS, RouterMetrics
from tandem.metrics.scrape import declared

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_lists_every_metric_with_its_type_and_labels():
    section = README.read_text().split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(tandem_\w+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    table = {name: (kind, labels.strip()) for name, kind, labels in rows}
    assert table == {m.name: (m.type, ", ".join(m.labels) or "-") for m in METRICS}


def test_names_follow_prometheus_conventions():
    for m in METRICS:
        assert re.fullmatch(r"tandem_(router|worker)_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        if m.type == "histogram":
            assert m.name.endswith(("_seconds", "_size", "_step")), m.name
        assert "request_id" not in m.labels and m.help, m.name
    assert len({m.name for m in METRICS}) == len(METRICS)


def test_a_fresh_router_registry_declares_its_metrics_before_any_request():
    text = generate_latest(RouterMetrics("m").registry).decode()
    router = {m.name for m in METRICS if m.name.startswith("tandem_router_")}
    collected = {"tandem_router_worker_up", "tandem_router_worker_info",
                 "tandem_router_worker_requests_in_flight", "tandem_router_migrations_total",
                 "tandem_router_prefill_decisions_total"}  # fmt: skip
    # The rest come from the collector that watch() registers (it needs the registry).
    assert declared(text) == router - collected
    assert "_created" not in text  # no creation-time series: half the scrape, unused
