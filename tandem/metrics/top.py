"""``tandem top``: a live terminal view of a running cluster, from its metrics.

    tandem top --target 127.0.0.1:9100        the router's metrics address
    tandem top --file RUN/prometheus-targets.json   a Prometheus file_sd file
                                              (tandem serve --metrics, tandem ray up)

Every ``interval`` seconds it scrapes the router, finds the workers from the
router's ``tandem_router_worker_info`` (each worker reports its metrics address
in Status) or from the file, scrapes each, and redraws one frame: the router's
request rate, errors and TTFT / inter-token latency percentiles over the last
minute, then one row per worker (role, tensor-parallel ranks, up, queue, running,
its recent decode step in ms, a KV usage bar, tokens/s, KV transfer MB/s,
prefix-cache hit rate). Rates are between the last two scrapes; percentiles use
the bucket counts observed within the window, as
``histogram_quantile(rate(...[1m]))`` would. Not a TTY (or ``--once``): frames
are printed one after another, without clearing the screen.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tandem.metrics import targets
from tandem.metrics.scrape import (
    Sample,
    ScrapeError,
    buckets,
    delta,
    quantile,
    scrape,
    total,
    worker_targets,
)

WINDOW_S = 60.0
BAR = 10


@dataclass
class Poll:
    """One round of scrapes: the router's samples and each worker's, by address."""

    at: float
    router: list[Sample] | None
    workers: dict[str, list[Sample] | None]  # None: unreachable this round
    roles: dict[str, str] = field(default_factory=dict)  # address -> role, where known
    up: dict[str, str] = field(default_factory=dict)  # address -> "1"/"0" (the router's view)
    errors: list[str] = field(default_factory=list)


class ClusterView:
    """Scrapes a cluster and renders frames; ``poll()`` then ``render()``."""

    def __init__(self, target: str | None = None, targets_file: str | Path | None = None):
        if not target and not targets_file:
            raise ValueError("give the router's metrics address or a file_sd targets file")
        self.target = target
        self.targets_file = Path(targets_file) if targets_file else None
        self.polls: deque[Poll] = deque()
        self.router_address = target

    def poll(self, now: float | None = None) -> Poll:
        now = time.monotonic() if now is None else now
        router_address, workers, roles = self._targets()
        self.router_address = router_address
        errors: list[str] = []
        router = None
        if router_address:
            try:
                router = scrape(router_address)
            except ScrapeError as exc:
                errors.append(str(exc))
        up: dict[str, str] = {}
        if router is not None:
            grpc_up = {s.labels["worker"]: f"{s.value:.0f}" for s in router
                       if s.name == "tandem_router_worker_up"}  # fmt: skip
            for address, info in worker_targets(router).items():
                up[address] = grpc_up.get(info.labels["worker"], "-")
                if self.targets_file is None:
                    workers.append(address)
                    roles[address] = info.labels.get("role", "?")
        scraped: dict[str, list[Sample] | None] = {}
        for address in workers:
            try:
                scraped[address] = scrape(address)
            except ScrapeError as exc:
                scraped[address] = None
                errors.append(str(exc))
        p = Poll(now, router, scraped, roles, up, errors)
        self.polls.append(p)
        while len(self.polls) > 2 and now - self.polls[1].at >= WINDOW_S:
            self.polls.popleft()  # keep one poll at least WINDOW_S old
        return p

    def _targets(self) -> tuple[str | None, list[str], dict[str, str]]:
        if self.targets_file is None:
            return self.target, [], {}
        try:
            listed = targets.read(self.targets_file)
        except (OSError, ValueError) as exc:
            raise ScrapeError(f"cannot read targets file {self.targets_file}: {exc}") from exc
        router, workers, roles = self.target, [], {}
        for address, role in listed:
            if role == "router":
                router = router or address
            else:
                workers.append(address)
                roles[address] = role
        return router, workers, roles

    # ---- rendering -------------------------------------------------------------------

    def render(self) -> str:
        if not self.polls:
            return "no data yet"
        now, first = self.polls[-1], self.polls[0]
        prev = self.polls[-2] if len(self.polls) > 1 else None
        lines = [f"tandem top  {time.strftime('%Y-%m-%d %H:%M:%S')}  "
                 f"router metrics {self.router_address or '-'}"]  # fmt: skip
        lines += self._router_lines(now, first)
        lines.append("")
        lines.append(f"{'WORKER':<28} {'ROLE':<8} {'TP':>2} {'UP':>2} {'QUEUE':>5} {'RUN':>4} "
                     f"{'STEP':>6}  {'KV USAGE':<17} {'TOK/S':>7} {'KV MB/S':>8} "
                     f"{'HIT':>5}")  # fmt: skip
        for address, samples in sorted(now.workers.items()):
            before = prev.workers.get(address) if prev else None
            lines.append(self._worker_line(address, samples, before, now, prev))
        if not now.workers:
            lines.append("(no workers with a metrics address)")
        lines += [f"! {e}" for e in now.errors]
        return "\n".join(lines)

    def _router_lines(self, now: Poll, first: Poll) -> list[str]:
        """Rates and percentiles between ``first`` (the window's oldest poll) and ``now``."""
        r = now.router
        if r is None:
            return ["router: unreachable" if self.router_address else "router: none listed"]
        old = first.router if first is not now and now.at > first.at else None
        name = "tandem_router_requests_total"
        ok, all_ = total(r, name, code="OK"), total(r, name)
        if old is not None:
            span = now.at - first.at
            done = _increase(all_, total(old, name))
            ok = _increase(ok, total(old, name, code="OK"))  # in the window, as the rest
            rate, errors, where = done / span, done - ok, f"last {span:.0f} s"
        else:
            rate, errors, where = 0.0, all_ - ok, "since start"
        line = (f"requests  {total(r, 'tandem_router_requests_in_flight'):.0f} in flight  "
                f"{rate:.2f} req/s  {ok:.0f} ok  {errors:.0f} errors ({where})")  # fmt: skip
        lat = []
        for label, metric in (("TTFT", "tandem_router_time_to_first_token_seconds"),
                              ("ITL", "tandem_router_inter_token_latency_seconds")):  # fmt: skip
            counts = buckets(r, metric)
            if old is not None:
                counts = delta(counts, buckets(old, metric))
            p50, p99 = quantile(0.5, counts), quantile(0.99, counts)
            lat.append(f"{label} p50 {_seconds(p50)} p99 {_seconds(p99)}")
        return [line, "latency   " + "   ".join(lat) + f"  ({where})"]

    def _worker_line(self, address, samples, before, now, prev) -> str:
        role = now.roles.get(address, "?")
        if samples is None:
            return f"{address:<28} {role:<8} unreachable"
        worker = next((s.labels["worker"] for s in samples if "worker" in s.labels), address)
        role = next((s.labels["role"] for s in samples if "role" in s.labels), role)
        used = total(samples, "tandem_worker_kv_blocks_used")
        blocks = total(samples, "tandem_worker_kv_blocks_capacity")
        ratio = used / blocks if blocks else 0.0
        fill = round(ratio * BAR)
        bar = f"[{'#' * fill}{'.' * (BAR - fill)}] {ratio:4.0%}"
        dt = now.at - prev.at if prev else 0.0
        tok_s = mb_s = 0.0
        if before is not None and dt > 0:
            gen = "tandem_worker_generated_tokens_total"
            tok_s = _increase(total(samples, gen), total(before, gen)) / dt
            kv = "tandem_worker_kv_transfer_bytes_total"
            mb_s = _increase(total(samples, kv), total(before, kv)) / dt / 1e6
        queries = total(samples, "tandem_worker_prefix_cache_query_tokens_total")
        hits = total(samples, "tandem_worker_prefix_cache_hit_tokens_total")
        hit = f"{hits / queries:5.0%}" if queries else "    -"
        mark = now.up.get(address, "-")
        width = total(samples, "tandem_worker_tensor_parallel_ranks")
        tp = f"{width:.0f}" if width else "-"  # a worker that does not export it
        step = total(samples, "tandem_worker_decode_step_seconds")
        step_ms = f"{step * 1000:.0f}ms" if step else "-"  # none run yet (or not exported)
        return (f"{worker[:28]:<28} {role:<8} {tp:>2} {mark:>2} "
                f"{total(samples, 'tandem_worker_queue_depth'):>5.0f} "
                f"{total(samples, 'tandem_worker_running_requests'):>4.0f} {step_ms:>6}  {bar:<17} "
                f"{tok_s:>7.1f} {mb_s:>8.1f} {hit}")  # fmt: skip


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def run(
    target: str | None,
    targets_file: str | None,
    interval: float = 1.0,
    once: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """Redraw every ``interval`` seconds until interrupted; ``once``: two scrapes
    ``interval`` apart (for rates), one frame, exit (1 if the router is unreachable)."""
    view = ClusterView(target, targets_file)
    tty = out.isatty() and not once
    try:
        while True:
            view.poll()
            if once and len(view.polls) < 2:
                time.sleep(interval)
                continue
            frame = view.render()
            out.write(("\x1b[H\x1b[2J" if tty else "") + frame + "\n")
            out.flush()
            if once:
                return 1 if view.polls[-1].router is None else 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _increase(now: float, before: float) -> float:
    """A counter's increase between two scrapes; one that went back was reset (its
    process restarted), and counts from 0 again, as Prometheus' ``rate`` takes it."""
    return now - before if now >= before else now
