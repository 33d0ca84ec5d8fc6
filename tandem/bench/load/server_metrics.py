"""The servers' side of a load run: ``tandem bench load --metrics ADDRESS``.

Before and after the run, the router's metrics (ADDRESS: its metrics address) and
every worker's (found from the router's ``tandem_router_worker_info``) are
scraped. With ``--out`` the texts are saved as ``server-metrics/{before,after}/
<process>.prom``; either way one comparison is printed under the report's table:
what the router counted during the run against what the client measured (requests,
output tokens, TTFT and ITL percentiles from the router's histogram buckets,
which are bucket-resolution estimates, as Prometheus' ``histogram_quantile`` is),
where the router had prompts prefilled and why (the disaggregation rule's counts),
then a line per decode worker (the sequences its steps held) and one per worker
whose prefix cache was looked up during the run (its hit rate: prompt tokens found
cached over prompt tokens looked up).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tandem.bench.load.metrics import Summary
from tandem.metrics.scrape import (
    ScrapeError,
    buckets,
    delta,
    fetch,
    parse,
    quantile,
    total,
    worker_targets,
)

log = logging.getLogger(__name__)


def snapshot(router_address: str) -> dict[str, str]:
    """Process name ("router", or a worker's id) -> its metrics text, now. The router's
    must answer (ScrapeError); a worker that does not (it died, and the router still
    lists it) is left out with a warning: the rest of the view stands."""
    texts = {"router": fetch(router_address)}
    for address, info in worker_targets(parse(texts["router"])).items():
        name = info.labels.get("worker_id") or address
        try:
            texts[name] = fetch(address)
        except ScrapeError as exc:
            log.warning("load: worker %s's metrics left out: %s", name, exc)
    return texts


def write(before: dict[str, str], after: dict[str, str], out: str | Path) -> list[Path]:
    paths = []
    for when, texts in (("before", before), ("after", after)):
        folder = Path(out) / "server-metrics" / when
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            path = folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.prom"
            path.write_text(text)
            paths.append(path)
    return paths


def compare(before: dict[str, str], after: dict[str, str], client: Summary) -> str:
    """The router's counts over the run and the client's same figures, a line each;
    then a line per decode worker: how many sequences its steps held (what its KV
    memory and ``reserve_output_tokens`` let it run at once) and how many it preempted;
    then each worker's prefix hit rate over the run."""
    b, a = parse(before["router"]), parse(after["router"])

    def moved(name: str, **labels: str) -> float:
        return total(a, name, **labels) - total(b, name, **labels)

    percentiles = []
    for label, metric in (("TTFT", "tandem_router_time_to_first_token_seconds"),
                          ("ITL", "tandem_router_inter_token_latency_seconds")):  # fmt: skip
        counts = delta(buckets(a, metric), buckets(b, metric))
        p50, p99 = quantile(0.5, counts), quantile(0.99, counts)
        percentiles.append(f"{label} p50 {_ms(p50)} p99 {_ms(p99)}")
    ok = moved("tandem_router_requests_total", code="OK")
    failed = moved("tandem_router_requests_total") - ok
    server = (f"server: {ok:.0f} ok, {failed:.0f} failed, "
              f"{moved('tandem_router_generation_tokens_total'):.0f} output tokens; "
              + ", ".join(percentiles) + " (router histograms)")  # fmt: skip
    c = client
    ours = (f"client: {c.completed} ok, {c.failed} failed, {c.output_tokens} output tokens; "
            f"TTFT p50 {c.ttft_ms.median:.0f} ms p99 {c.ttft_ms.p99:.0f} ms, "
            f"ITL p50 {c.itl_ms.median:.0f} ms p99 {c.itl_ms.p99:.0f} ms")  # fmt: skip
    workers = [*_decode_lines(before, after), *_prefix_lines(before, after)]
    missing = sorted((set(before) ^ set(after)) - {"router"})
    if missing:  # a worker's counts over the run need both of its scrapes
        workers.append("workers scraped only before or only after the run (left out): "
                       + ", ".join(missing))  # fmt: skip
    return "\n".join([server, ours, *_decisions(a, b), *workers])


def _decisions(a: list, b: list) -> list[str]:
    """The router's prefill decisions over the run, as one line ("prefilled: on the
    decode worker 12 (short 10, ...); on the prefill pool 4 (...)"), or nothing when
    the router decided nothing."""
    name = "tandem_router_prefill_decisions_total"
    moved: dict[str, dict[str, float]] = {}
    for x in a:
        if x.name == name:
            n = x.value - total(b, name, **x.labels)
            if n > 0:
                where = moved.setdefault(x.labels["where"].replace("_", " "), {})
                where[x.labels["reason"].replace("_", " ")] = n
    if not moved:
        return []
    parts = [f"on the {where} {sum(reasons.values()):.0f} (" + ", ".join(
        f"{reason} {n:.0f}" for reason, n in sorted(reasons.items(), key=lambda r: -r[1])) + ")"
        for where, reasons in sorted(moved.items())]  # fmt: skip
    return ["prefilled: " + "; ".join(parts)]


def _decode_lines(before: dict[str, str], after: dict[str, str]) -> list[str]:
    lines = []
    batch = "tandem_worker_batch_size"
    for name in _workers(before, after):
        a, b = parse(after[name]), parse(before[name])
        steps = total(a, f"{batch}_count", role="decode") - total(b, f"{batch}_count")
        if steps <= 0:  # a prefill worker, or no step during the run
            continue
        mean = (total(a, f"{batch}_sum") - total(b, f"{batch}_sum")) / steps
        p99 = quantile(0.99, delta(buckets(a, batch), buckets(b, batch)))
        preempted = total(a, "tandem_worker_preemptions_total") - total(
            b, "tandem_worker_preemptions_total"
        )
        lines.append(
            f"decode {name}: {mean:.1f} sequences a step on average, p99 "
            f"{'-' if p99 is None else f'{p99:.0f}'} (histogram), {preempted:.0f} preempted"
        )
    return lines


def _prefix_lines(before: dict[str, str], after: dict[str, str]) -> list[str]:
    looked_up, found = (f"tandem_worker_prefix_cache_{kind}_tokens_total"
                        for kind in ("query", "hit"))  # fmt: skip
    lines = []
    for name in _workers(before, after):
        a, b = parse(after[name]), parse(before[name])
        looked = total(a, looked_up) - total(b, looked_up)
        if looked <= 0:  # no prompt reached its cache during the run
            continue
        hit = total(a, found) - total(b, found)
        role = next((x.labels.get("role", "worker") for x in a if x.name == looked_up), "worker")
        lines.append(f"prefix cache, {role} {name}: {hit / looked:.1%} hit ({hit:.0f} of "
                     f"{looked:.0f} prompt tokens looked up)")  # fmt: skip
    return lines


def _workers(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The workers scraped both before and after the run."""
    return sorted((set(before) & set(after)) - {"router"})


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"
