"""A run's results: the terminal table, ``summary.json``, ``requests.csv`` and PNG plots."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

from tandem.bench.load.metrics import RequestRecord, Summary
from tandem.bench.load.runner import LoadResult

CDF_PLOT = "latency_cdf.png"
TIMELINE_PLOT = "token_timeline.png"


def table(result: LoadResult) -> str:
    s, cfg = result.summary, result.config
    lines = [
        f"tandem bench load: {result.model.model_id} at {cfg.target}",
        f"  {cfg.describe()}; {cfg.dataset.describe()}; seed {cfg.seed}",
        f"requests     {s.completed} completed, {s.failed} failed, in {s.duration_s:.2f} s "
        f"(at most {s.max_concurrency_seen} in flight)",
        f"tokens       {s.input_tokens} prompt, {s.output_tokens} output",
        f"throughput   {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s,"
        f" {s.total_token_throughput:.1f} total tok/s",
        goodput_line(s),
    ]
    if s.errors:
        lines.append("errors       " + ", ".join(f"{k} {v}" for k, v in s.errors.items()))
        lines += [f"             {k} (first): {v}" for k, v in s.error_details.items()]
    lines += [f"WARNING      {b.describe()}" for b in s.bursts]
    lines += ["", f"{'latency (ms)':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"]
    for name, st in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms),
                     ("E2E", s.e2e_ms)):  # fmt: skip
        lines.append(f"{name:<14}{st.mean:>10.1f}{st.median:>10.1f}{st.p90:>10.1f}{st.p99:>10.1f}")
    return "\n".join(lines)


def goodput_line(s: Summary) -> str:
    if not s.slo.given:
        return (f"goodput      {s.goodput:.2f} req/s (no SLO given: completed requests; "
                f"{s.slo_attainment:.1%} of all)")  # fmt: skip
    return (f"goodput      {s.goodput:.2f} req/s; SLO attainment {s.slo_attainment:.1%} "
            f"({s.good_requests}/{s.num_requests} within {slo_text(s)})")  # fmt: skip


def slo_text(s: Summary) -> str:
    parts = []
    if s.slo.ttft_ms is not None:
        parts.append(f"TTFT <= {s.slo.ttft_ms:g} ms")
    if s.slo.tpot_ms is not None:
        parts.append(f"TPOT <= {s.slo.tpot_ms:g} ms")
    return ", ".join(parts)


def to_json(result: LoadResult) -> dict:
    cfg = dataclasses.asdict(result.config)
    del cfg["connect"]  # how it connected is no result, and it may hold the API key
    cfg["dataset"]["input_len"] = result.config.dataset.input_len.describe()
    cfg["dataset"]["output_len"] = result.config.dataset.output_len.describe()
    return _finite({
        "model": dataclasses.asdict(result.model),
        "config": cfg,
        "started_at": result.started_at,
        "summary": dataclasses.asdict(result.summary),
    })  # fmt: skip


CSV_FIELDS = (
    "index", "send_time_s", "input_len", "prompt_tokens", "output_len", "output_tokens",
    "ttft_ms", "tpot_ms", "e2e_ms", "itl_mean_ms", "responses", "finish_reason", "error",
    "met_slo",
)  # fmt: skip


def write(result: LoadResult, out: str | Path, plots: bool = True) -> list[Path]:
    """summary.json, requests.csv and (with ``plots``) the PNGs into ``out``; their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(to_json(result), indent=2) + "\n")
    csv_path = out / "requests.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in result.records:
            w.writerow(_csv_row(r, result.config.slo.met(r)))
    paths = [summary_path, csv_path]
    if plots:
        paths += [plot_cdfs(result.records, out / CDF_PLOT),
                  plot_timeline(result.records, out / TIMELINE_PLOT)]  # fmt: skip
    return paths


def _csv_row(r: RequestRecord, met: bool) -> list:
    def ms(x: float | None) -> str:
        return "" if x is None else f"{x * 1e3:.3f}"

    itls = r.itls
    return [
        r.index, f"{r.send_time:.6f}", "" if r.input_len is None else r.input_len,
        r.prompt_tokens, r.output_len, r.output_tokens, ms(r.ttft), ms(r.tpot), ms(r.e2e),
        ms(sum(itls) / len(itls) if itls else None), len(r.chunk_times),
        r.finish_reason or "", r.error or "", int(met),
    ]  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(records: list[RequestRecord], path: Path) -> Path:
    import numpy as np

    plt = _pyplot()
    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "TPOT": [r.tpot for r in done if r.tpot is not None],
        "ITL": [g for r in done for g in r.itls],
        "E2E latency": [r.e2e for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, seconds) in zip(axes.flat, series.items(), strict=True):
        ms = np.sort(np.asarray(seconds) * 1e3)
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(ms, p), color="grey", lw=0.6, ls=":")
        ax.set_title(f"{name} ({len(ms)} samples; dotted: p50, p90, p99)", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(records: list[RequestRecord], path: Path) -> Path:
    """Each request as a row: waiting for the first token, then streaming; below it,
    output tokens per second over the run."""
    import numpy as np

    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    stamps, counts = [], []
    for row, r in enumerate(records):
        if not r.chunk_times:
            top.plot([r.send_time], [row], "x", color="red", ms=4)
            continue
        first, last = r.send_time + r.chunk_times[0], r.send_time + r.chunk_times[-1]
        top.plot([r.send_time, first], [row, row], color="orange", lw=2)
        top.plot([first, last], [row, row], color="tab:blue" if r.ok else "red", lw=2)
        stamps += [r.send_time + t for t in r.chunk_times]
        counts += r.chunk_tokens
    top.set_ylabel("request")
    top.set_title("orange: waiting for the first token; blue: streaming; red: failed",
                  fontsize=9)  # fmt: skip
    if stamps:
        end = max(stamps)
        bins = max(1, min(100, len(stamps) // 5))
        hist, edges = np.histogram(stamps, bins=bins, range=(0, end), weights=counts)
        width = edges[1] - edges[0]
        bottom.bar(edges[:-1], hist / width, width=width, align="edge", color="tab:blue")
    bottom.set_xlabel("seconds since the first request was sent")
    bottom.set_ylabel("output tok/s")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _finite(obj):
    """JSON has no NaN or Infinity: they become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
