"""Metrics: what every process exports to Prometheus, and the tools that read it.

export.py   the metric list (``METRICS``), the router's and the workers'
            registries, and the HTTP endpoint each process serves
scrape.py   fetching and parsing a process's /metrics, histogram quantiles
top.py      ``tandem top``: a live terminal view of a running cluster
"""

from tandem.metrics.export import (
    METRICS,
    Metric,
    MetricsEndpoint,
    RequestTrack,
    RouterMetrics,
    WorkerMetrics,
)

__all__ = ["METRICS", "Metric", "MetricsEndpoint", "RequestTrack", "RouterMetrics",
           "WorkerMetrics"]  # fmt: skip
