"""Prometheus metrics: what each process exports, and the HTTP endpoint that serves it.

Every process (router, prefill worker, decode worker) has its own registry and,
when its config sets ``metrics_port``, serves it as Prometheus text on
``http://HOST:PORT/metrics`` (HOST: the process's gRPC host; port 0 picks a free
one, which the process reports on its READY line; None, the default: off).

Names follow Prometheus' conventions (base units in the name: seconds, bytes,
tokens; counters end in ``_total``) and, where they mean the same thing, match
what vLLM and SGLang export (time to first token, inter-token latency, prefix
cache queries and hits in tokens). Labels are bounded: ``model`` everywhere,
``worker`` and ``role`` on workers and on the router's view of them, gRPC status
codes, finish reasons and failure causes; never a request id. The README's
"Monitoring" section lists every metric; ``METRICS`` below is that list, and a
test checks that it, the README and a real scrape agree.

Numbers the worker already keeps for ``Status`` (queue, KV blocks, prefix cache,
transfer totals) are read at scrape time by a collector, so a scrape is
consistent with ``Status`` and costs the engine nothing; histograms are observed
as events happen (the engine thread after each step; the KV transfer thread when
a transfer ends; the router's event loop per response).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from tandem.config import host_port
from tandem.errors import ConfigError

log = logging.getLogger(__name__)
# No <name>_created series: they double the scrape and no dashboard reads them.
disable_created_metrics()


class Metric(NamedTuple):
    name: str  # as scraped (counters with their _total)
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str


_ROUTER = ("model",)
_WORKER = ("worker", "role", "model")
_POOL = ("worker", "role")
METRICS: tuple[Metric, ...] = (
    # ---- router ----
    Metric("tandem_router_requests_total", "counter", (*_ROUTER, "code", "finish_reason"),
           "Generate requests ended, by gRPC status code and finish reason (none: not "
           "finished)"),
    Metric("tandem_router_requests_in_flight", "gauge", _ROUTER,
           "Generate requests admitted and not yet ended"),
    Metric("tandem_router_admission_rejections_total", "counter", (*_ROUTER, "reason"),
           "Calls refused with RESOURCE_EXHAUSTED by the router's limits (generations, "
           "tokenize and model info), by the limit that refused them"),
    Metric("tandem_router_prompt_tokens_total", "counter", _ROUTER,
           "Prompt tokens of finished requests"),
    Metric("tandem_router_generation_tokens_total", "counter", _ROUTER,
           "Tokens generated for finished requests (the usage the client got)"),
    Metric("tandem_router_time_to_first_token_seconds", "histogram", _ROUTER,
           "From the request's arrival to its first token streamed"),
    Metric("tandem_router_inter_token_latency_seconds", "histogram", _ROUTER,
           "Between successive streamed responses of one request"),
    Metric("tandem_router_time_per_output_token_seconds", "histogram", _ROUTER,
           "Per finished request: (end-to-end - time to first token) / (tokens - 1)"),
    Metric("tandem_router_e2e_request_latency_seconds", "histogram", _ROUTER,
           "From the request's arrival to its last response, finished requests"),
    Metric("tandem_router_queue_time_seconds", "histogram", _ROUTER,
           "From the request's arrival until a decode worker reserved its KV blocks"),
    Metric("tandem_router_worker_up", "gauge", _POOL,
           "1 while the router places requests on the worker, 0 while it is down"),
    Metric("tandem_router_worker_info", "gauge", (*_POOL, "worker_id", "metrics_address"),
           "1 per registered worker: its id and where its metrics are scraped (tandem top "
           "finds the workers here)"),
    Metric("tandem_router_worker_requests_in_flight", "gauge", _POOL,
           "Requests this router has in flight on the worker"),
    Metric("tandem_router_worker_retries_total", "counter", ("role",),
           "Worker calls that failed before any work and were given to another worker"),
    Metric("tandem_router_migrations_total", "counter", (),
           "Attempts that took over a lost one (a worker or its KV transfer was lost; "
           "a request moved twice counts twice)"),
    Metric("tandem_router_prefill_decisions_total", "counter", ("where", "reason"),
           "Where prompts were prefilled (prefill_pool or decode_worker) and why"),
    # ---- workers ----
    Metric("tandem_worker_queue_depth", "gauge", _WORKER,
           "Requests accepted and waiting to be scheduled"),
    Metric("tandem_worker_running_requests", "gauge", _WORKER, "Requests in the running batch"),
    Metric("tandem_worker_kv_blocks_used", "gauge", _WORKER, "KV cache blocks in use"),
    Metric("tandem_worker_kv_blocks_free", "gauge", _WORKER, "KV cache blocks free"),
    Metric("tandem_worker_kv_blocks_capacity", "gauge", _WORKER, "KV cache blocks in the pool"),
    Metric("tandem_worker_tensor_parallel_ranks", "gauge", _WORKER,
           "Processes (and devices) the worker's model is split over"),
    Metric("tandem_worker_decode_step_seconds", "gauge", _WORKER,
           "Recent mean duration of a step that only decodes (0 until one ran)"),
    Metric("tandem_worker_prefill_token_seconds", "gauge", _WORKER,
           "Recent mean time each prompt token adds to a step (0 until one ran)"),
    Metric("tandem_worker_kv_usage_ratio", "gauge", _WORKER,
           "KV cache blocks in use / blocks in the pool (0 to 1)"),
    Metric("tandem_worker_prefix_cache_query_tokens_total", "counter", _WORKER,
           "Prompt tokens looked up in the prefix cache"),
    Metric("tandem_worker_prefix_cache_hit_tokens_total", "counter", _WORKER,
           "Prompt tokens found in the prefix cache (hit rate: hits / queries)"),
    Metric("tandem_worker_prefix_cache_shipped_query_tokens_total", "counter", _WORKER,
           "Decode workers: of the tokens looked up, those of prompts whose KV a prefill "
           "worker sends (a hit there is a block not sent, not a token not computed)"),
    Metric("tandem_worker_prefix_cache_shipped_hit_tokens_total", "counter", _WORKER,
           "Decode workers: of the tokens found, those of prompts whose KV a prefill "
           "worker sends"),
    Metric("tandem_worker_preemptions_total", "counter", _WORKER,
           "Running sequences preempted for lack of KV blocks (swapped out or recomputed)"),
    Metric("tandem_worker_host_kv_blocks_used", "gauge", _WORKER,
           "KV blocks held in the host-memory tier (prefix blocks and swapped sequences)"),
    Metric("tandem_worker_host_swaps_out_total", "counter", _WORKER,
           "Preempted sequences swapped out to the host tier instead of recomputed"),
    Metric("tandem_worker_host_swaps_in_total", "counter", _WORKER,
           "Swapped sequences brought back from the host tier"),
    Metric("tandem_worker_host_prefix_hit_blocks_total", "counter", _WORKER,
           "Prefix blocks served back from the host tier instead of recomputed"),
    Metric("tandem_worker_requests_served_total", "counter", _WORKER,
           "Requests this worker completed successfully"),
    Metric("tandem_worker_prefilled_here_total", "counter", _WORKER,
           "Decode workers: requests prefilled here, with no KV received"),
    Metric("tandem_worker_generated_tokens_total", "counter", _WORKER,
           "Tokens sampled by the engine (prefill workers: first tokens)"),
    Metric("tandem_worker_step_seconds", "histogram", _WORKER, "Duration of one engine step"),
    Metric("tandem_worker_batch_size", "histogram", _WORKER, "Sequences in one engine step"),
    Metric("tandem_worker_tokens_per_step", "histogram", _WORKER,
           "Tokens computed in one engine step (prompt chunks and decodes)"),
    Metric("tandem_worker_kv_transfers_total", "counter", _WORKER,
           "KV transfers completed (sent by prefill workers, received by decode workers)"),
    Metric("tandem_worker_kv_transfer_bytes_total", "counter", (*_WORKER, "direction"),
           "KV payload bytes, by direction (sent or received)"),
    Metric("tandem_worker_kv_transfer_seconds", "histogram", _WORKER,
           "Duration of one completed KV transfer"),
    Metric("tandem_worker_kv_transfer_failures_total", "counter", (*_WORKER, "cause"),
           "KV transfers that failed, by cause"),
)  # fmt: skip
_BY_NAME = {m.name: m for m in METRICS}
FINISH_REASONS = {1: "stop", 2: "length", 3: "cancelled", 4: "error"}  # tandem.v1.FinishReason

# Seconds: vLLM's TTFT buckets, stretched to a CPU's slow end.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)  # fmt: skip
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _help(name: str) -> str:
    return _BY_NAME[name].help


def _make(cls, registry: CollectorRegistry, name: str, **kwargs):
    """A prometheus_client metric as METRICS describes it (a counter's name loses its
    _total here: the client adds it back to the sample)."""
    spec = _BY_NAME[name]
    return cls(name.removesuffix("_total"), spec.help, spec.labels, registry=registry, **kwargs)


def _histogram(registry: CollectorRegistry, name: str, buckets, labels: dict[str, str]):
    """A histogram with its labels bound."""
    return _make(Histogram, registry, name, buckets=buckets).labels(**labels)


# ---- router ------------------------------------------------------------------------------


class RouterMetrics:
    """The router's registry. The gateway calls ``track()`` per generation (gRPC or
    HTTP); the relay counts retries and queue time; the rest is read from the
    worker registry and the disaggregation policy at scrape time (``watch``)."""

    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        m = {"model": model}
        self._requests = _make(Counter, r, "tandem_router_requests_total")
        self._rejections = _make(Counter, r, "tandem_router_admission_rejections_total")
        self._retries = _make(Counter, r, "tandem_router_worker_retries_total")
        self.in_flight = _make(Gauge, r, "tandem_router_requests_in_flight").labels(**m)
        self.prompt_tokens = _make(Counter, r, "tandem_router_prompt_tokens_total").labels(**m)
        self.generation_tokens = _make(Counter, r, "tandem_router_generation_tokens_total").labels(
            **m
        )
        self.ttft = _histogram(r, "tandem_router_time_to_first_token_seconds",
                               LATENCY_BUCKETS, m)  # fmt: skip
        self.itl = _histogram(r, "tandem_router_inter_token_latency_seconds", ITL_BUCKETS, m)
        self.tpot = _histogram(r, "tandem_router_time_per_output_token_seconds", ITL_BUCKETS, m)
        self.e2e = _histogram(r, "tandem_router_e2e_request_latency_seconds",
                              LATENCY_BUCKETS, m)  # fmt: skip
        self.queue_time = _histogram(r, "tandem_router_queue_time_seconds", LATENCY_BUCKETS, m)

    def track(self) -> RequestTrack:
        """One Generate call, from its arrival (now) to its end."""
        return RequestTrack(self)

    def ended(self, code: str, finish_reason: str) -> None:
        self._requests.labels(model=self.model, code=code, finish_reason=finish_reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejections.labels(model=self.model, reason=reason).inc()

    def retried(self, role: str) -> None:
        self._retries.labels(role=role).inc()

    def watch(self, workers: Callable[[], Iterable], relay) -> None:
        """Export the registry's workers (``Worker`` objects) and the relay's counts."""
        self.registry.register(_RouterCollector(workers, relay))


class RequestTrack:
    """Times one request's responses as the client gets them (the router's event loop)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.arrived = time.monotonic()
        self._first: float | None = None
        self._last = 0.0
        self._ended = False
        metrics.in_flight.inc()

    def response(self, response) -> None:
        """Before ``response`` (a GenerateResponse) is handed to the client. The last
        one ends the request here, so that a client that has it finds it counted."""
        m, now = self.metrics, time.monotonic()
        if self._first is None:
            self._first = now
            m.ttft.observe(now - self.arrived)
        else:
            m.itl.observe(now - self._last)
        self._last = now
        if response.finish_reason:
            usage = response.usage
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
            m.e2e.observe(now - self.arrived)
            if usage.completion_tokens > 1:
                m.tpot.observe((now - self._first) / (usage.completion_tokens - 1))
            self.end("OK", finish_reason=FINISH_REASONS.get(response.finish_reason, "other"))

    def end(self, code: str, reason: str = "", finish_reason: str = "none") -> None:
        """Once (later calls are ignored), however the call ended: ``code`` is its gRPC
        status name; ``reason`` names the router limit behind a RESOURCE_EXHAUSTED."""
        if self._ended:
            return
        self._ended = True
        m = self.metrics
        m.in_flight.dec()
        m.ended(code, finish_reason)
        if code == "RESOURCE_EXHAUSTED":
            m.rejected(reason or "worker")


class _RouterCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable], relay) -> None:
        self._workers = workers
        self._relay = relay

    def collect(self):
        up = _gauge("tandem_router_worker_up", _POOL)
        info = _gauge("tandem_router_worker_info", (*_POOL, "worker_id", "metrics_address"))
        inflight = _gauge("tandem_router_worker_requests_in_flight", _POOL)
        for w in self._workers():
            labels = [w.address, w.pool.value]
            up.add_metric(labels, 1.0 if w.healthy else 0.0)
            info.add_metric([*labels, w.worker_id, w.metrics_address], 1.0)
            inflight.add_metric(labels, w.inflight)
        migrations = _counter("tandem_router_migrations_total", ())
        migrations.add_metric([], self._relay.migrations)
        decisions = _counter("tandem_router_prefill_decisions_total", ("where", "reason"))
        routing = self._relay.routing
        for reason, n in sorted(routing.counts.items()):
            where = "decode_worker" if routing.prefills_here(reason) else "prefill_pool"
            decisions.add_metric([where, reason.replace(" ", "_")], n)
        yield from (up, info, inflight, migrations, decisions)


# ---- workers -----------------------------------------------------------------------------


class WorkerMetrics:
    """A worker's registry: snapshot numbers read from ``server`` at scrape time
    (``status()``, ``transfer_metrics``, its engine's counters) and the step and
    transfer histograms, observed as they happen."""

    def __init__(self, server) -> None:
        self.registry = CollectorRegistry()
        self.labels = {
            "worker": server.worker_id, "role": server.role, "model": server.config.engine.model
        }  # fmt: skip
        r, m = self.registry, self.labels
        self.step_seconds = _histogram(r, "tandem_worker_step_seconds", LATENCY_BUCKETS, m)
        self.batch_size = _histogram(r, "tandem_worker_batch_size", COUNT_BUCKETS, m)
        self.tokens_per_step = _histogram(r, "tandem_worker_tokens_per_step", COUNT_BUCKETS, m)
        self.transfer_seconds = _histogram(
            r, "tandem_worker_kv_transfer_seconds", LATENCY_BUCKETS, m
        )
        r.register(_WorkerCollector(server, list(m.values())))

    def on_step(self, seconds: float, sequences: int, tokens: int) -> None:
        """Engine thread, after each step."""
        self.step_seconds.observe(seconds)
        self.batch_size.observe(sequences)
        self.tokens_per_step.observe(tokens)


class _WorkerCollector(Collector):
    def __init__(self, server, labels: list[str]) -> None:
        self._server = server
        self._labels = labels

    def collect(self):
        s, labels = self._server.status(), self._labels
        engine = self._server.engine
        for name, value in (
            ("tandem_worker_queue_depth", s.queue_depth),
            ("tandem_worker_running_requests", s.running),
            ("tandem_worker_kv_blocks_used", s.kv_blocks_used),
            ("tandem_worker_kv_blocks_free", s.kv_blocks_free),
            ("tandem_worker_kv_blocks_capacity", s.kv_blocks_total),
            ("tandem_worker_kv_usage_ratio", s.kv_blocks_used / max(1, s.kv_blocks_total)),
            ("tandem_worker_host_kv_blocks_used", s.host_blocks_used),
            ("tandem_worker_tensor_parallel_ranks", s.tensor_parallel_size),
            ("tandem_worker_decode_step_seconds", s.decode_step_seconds),
            ("tandem_worker_prefill_token_seconds", s.prefill_token_seconds),
        ):
            g = _gauge(name, _WORKER)
            g.add_metric(labels, value)
            yield g
        stats = engine.stats if engine is not None else None
        for name, value in (
            ("tandem_worker_prefix_cache_query_tokens_total", s.prefix_query_tokens),
            ("tandem_worker_prefix_cache_hit_tokens_total", s.prefix_hit_tokens),
            (
                "tandem_worker_prefix_cache_shipped_query_tokens_total",
                s.shipped_prefix_query_tokens,
            ),
            ("tandem_worker_prefix_cache_shipped_hit_tokens_total", s.shipped_prefix_hit_tokens),
            ("tandem_worker_preemptions_total", stats.preemptions if stats else 0),
            ("tandem_worker_requests_served_total", s.served),
            ("tandem_worker_prefilled_here_total", s.prefilled_here),
            ("tandem_worker_generated_tokens_total", stats.generated_tokens if stats else 0),
            ("tandem_worker_kv_transfers_total", s.kv_transfers_total),
            ("tandem_worker_host_swaps_out_total", s.host_swaps_out_total),
            ("tandem_worker_host_swaps_in_total", s.host_swaps_in_total),
            ("tandem_worker_host_prefix_hit_blocks_total", s.host_prefix_hit_blocks_total),
        ):
            c = _counter(name, _WORKER)
            c.add_metric(labels, value)
            yield c
        m = self._server.transfer_metrics
        nbytes = _counter("tandem_worker_kv_transfer_bytes_total", (*_WORKER, "direction"))
        nbytes.add_metric([*labels, "sent"], m.bytes_sent)
        nbytes.add_metric([*labels, "received"], m.bytes_received)
        failures = _counter("tandem_worker_kv_transfer_failures_total", (*_WORKER, "cause"))
        for cause, n in sorted(dict(m.failures).items()):
            failures.add_metric([*labels, cause.replace(" ", "_")], n)
        yield from (nbytes, failures)


def _gauge(name: str, labels) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _help(name), labels=list(labels))


def _counter(name: str, labels) -> CounterMetricFamily:
    # The family's name is without _total; the sample is exposed with it.
    return CounterMetricFamily(name.removesuffix("_total"), _help(name), labels=list(labels))


# ---- the endpoint ------------------------------------------------------------------------


class MetricsEndpoint:
    """``registry`` as Prometheus text over HTTP (``/metrics``; any path answers)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.address: str | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> str:
        """Bind ``host:port`` (0: a free port) and serve; returns "host:port"."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} (setting metrics_port): {exc}"
            ) from exc
        self.address = host_port(host, self._server.server_port)
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
