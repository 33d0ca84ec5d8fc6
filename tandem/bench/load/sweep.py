"""``tandem bench sweep``: one load per request rate (or concurrency), and the capacity.

Every point draws the same distributions with its own seed (``--seed`` + the
point's index), so no synthetic point replays another's prompts into the
server's prefix cache; a JSONL or ShareGPT file is one pool of prompts that
every point samples from (a file smaller than the points together repeats
prompts, as it does in vLLM's benchmark). Each point runs its own warm-up. The capacity
is the highest point whose SLO attainment, and that of every lower point, is at
least the target (default 90%): for a rate sweep, the rate that point sustained
(its completions a second from the first to the last, never more than it was
offered: a server that kept up with a tenth of a burst does not have the burst's
rate, and the run's ramp-up and drain do not count against one that kept up); for a
concurrency sweep, the rate it sustains with that many requests in flight (at
most as many as the run held at once), concurrency / mean end-to-end latency
(Little's law: the run's own throughput,
completed requests over its duration, also counts the run's ramp-down, when
fewer are in flight, and so understates the steady rate the more, the higher the
concurrency is). ``sweep.json`` records
it with the deployment under test (workers per pool, which the API cannot see,
so they are given on the command line) for ``tandem plan``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.load import report
from tandem.bench.load.runner import LoadConfig, LoadResult, run
from tandem.errors import InvalidRequestError

LATENCY_PLOT = "throughput_latency.png"
ATTAINMENT_PLOT = "slo_attainment.png"


@dataclass(frozen=True)
class SweepConfig:
    base: LoadConfig  # target, dataset, SLOs, request count; rate/concurrency are replaced
    rates: tuple[float, ...] = ()
    concurrencies: tuple[int, ...] = ()
    target_attainment: float = 0.9
    prefill_workers: int = 1  # the deployment under test
    decode_workers: int = 1

    def __post_init__(self) -> None:
        if bool(self.rates) == bool(self.concurrencies):
            raise InvalidRequestError(
                "sweep", "give one of --request-rates or --concurrencies (comma-separated)"
            )
        if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise InvalidRequestError("rates", f"--request-rates must be finite and > 0, "
                                      f"got {list(self.rates)}")  # fmt: skip
        if any(c < 1 for c in self.concurrencies):
            raise InvalidRequestError("concurrencies", f"--concurrencies must be >= 1, "
                                      f"got {list(self.concurrencies)}")  # fmt: skip
        if not 0 < self.target_attainment <= 1:
            raise InvalidRequestError("target_attainment", "--target-attainment must be in "
                                      f"(0, 1], got {self.target_attainment}")  # fmt: skip
        if self.prefill_workers < 0 or self.decode_workers < 1:
            raise InvalidRequestError(
                "workers",
                "--prefill-workers must be >= 0 (0: a colocated deployment) and "
                "--decode-workers >= 1",
            )

    @property
    def by(self) -> str:
        return "request_rate" if self.rates else "concurrency"

    def points(self) -> list[tuple[float, LoadConfig]]:
        """(x, the load config for it), in increasing x.

        Each point draws its own sample (seed + its index): with the same prompts, every
        point after the first would hit the server's prefix cache and look faster.
        """
        if self.rates:
            changes = [{"request_rate": r} for r in sorted(set(self.rates))]
        else:
            changes = [{"request_rate": math.inf, "max_concurrency": c}
                       for c in sorted(set(self.concurrencies))]  # fmt: skip
        points = []
        for i, change in enumerate(changes):
            cfg = dataclasses.replace(self.base, seed=self.base.seed + i, **change)
            points.append((change.get("max_concurrency", change["request_rate"]), cfg))
        return points


def run_sweep(
    config: SweepConfig, out: str | Path, on_point: Callable[[LoadResult], None] | None = None
) -> dict:
    """Runs every point, writes each one's report under ``out/<by>-<x>/``, then
    ``sweep.json`` and the two plots; returns what sweep.json holds."""
    out = Path(out)
    points = []
    for x, cfg in config.points():
        result = run(cfg)
        report.write(result, out / f"{config.by}-{x:g}", plots=True)
        if on_point is not None:
            on_point(result)
        points.append({"x": x, "summary": report.to_json(result)["summary"],
                       "model": result.model.model_id})  # fmt: skip
    data = sweep_json(config, points)
    (out / "sweep.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out)
    return data


def sweep_json(config: SweepConfig, points: list[dict]) -> dict:
    capacity = capacity_index(points, config.target_attainment)
    cap = points[capacity] if capacity is not None else None
    if cap is None:
        capacity_rps = None
    elif config.by == "request_rate":  # what it kept up with, no more than was offered
        kept = cap["summary"].get("completion_rate")
        if kept is None or not math.isfinite(kept):  # fewer than 2 completions
            kept = cap["summary"]["request_throughput"]
        capacity_rps = min(cap["x"], kept)
    else:  # Little's law over the steady part of the run (see the module's docstring)
        e2e_ms = cap["summary"]["e2e_ms"]["mean"]
        held = min(cap["x"], cap["summary"]["max_concurrency_seen"])  # fewer requests: less
        capacity_rps = held / (e2e_ms / 1e3) if e2e_ms else None
    base = config.base
    return {
        "by": config.by,
        "target": base.target,
        "model": points[0]["model"] if points else None,
        "deployment": {
            "prefill_workers": config.prefill_workers,
            "decode_workers": config.decode_workers,
        },  # fmt: skip
        "dataset": base.dataset.describe(),
        "slo": dataclasses.asdict(base.slo),
        "target_attainment": config.target_attainment,
        "capacity_point": capacity,
        "capacity_rps": capacity_rps,
        "points": points,
    }


def capacity_index(points: list[dict], target: float) -> int | None:
    """The last point before the first whose attainment falls below ``target``."""
    best = None
    for i, p in enumerate(points):
        attained = p["summary"]["slo_attainment"]
        if attained is None or attained < target:
            break
        best = i
    return best


def table(data: dict) -> str:
    x_name = "rate" if data["by"] == "request_rate" else "conc."
    head = (f"{x_name:>7}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>8}"
            f"{'TPOT p50':>10}{'p99':>8}{'attained':>10}{'goodput':>9}")  # fmt: skip
    lines = [head]
    for p in data["points"]:
        s = p["summary"]
        lines.append(
            f"{p['x']:>7g}{_f(s['request_throughput'], 2):>8}{_f(s['output_throughput'], 1):>11}"
            f"{_f(s['ttft_ms']['median'], 1):>10}{_f(s['ttft_ms']['p99'], 1):>8}"
            f"{_f(s['tpot_ms']['median'], 1):>10}{_f(s['tpot_ms']['p99'], 1):>8}"
            f"{_pct(s['slo_attainment']):>10}{_f(s['goodput'], 2):>9}"
        )
    target = f"{data['target_attainment']:.0%}"
    if data["capacity_rps"] is None:
        lines.append(f"capacity: no point reached {target} SLO attainment")
    else:
        lines.append(f"capacity: {data['capacity_rps']:.3g} req/s with SLO attainment >= {target} "
                     f"({data['by']} {data['points'][data['capacity_point']]['x']:g})")  # fmt: skip
    return "\n".join(lines)


def plot(data: dict, out: Path) -> list[Path]:
    plt = report._pyplot()
    pts = data["points"]
    xs = [p["x"] for p in pts]
    label = "request rate (req/s)" if data["by"] == "request_rate" else "max concurrency"
    thr = [p["summary"]["output_throughput"] or 0 for p in pts]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ys = [_nan(p["summary"][key][stat]) for p in pts]
            ax.plot(thr, ys, style, label=f"{name} {stat}")
        for x, t, p in zip(xs, thr, pts, strict=True):
            ax.annotate(f"{x:g}", (t, _nan(p["summary"][key]["median"])), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))  # fmt: skip
        slo = data["slo"][key]
        if slo is not None:
            ax.axhline(slo, color="red", lw=0.8, ls=":", label=f"SLO {slo:g} ms")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"throughput vs latency (points labelled by {label})", fontsize=10)
    fig.tight_layout()
    latency = out / LATENCY_PLOT
    fig.savefig(latency, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(xs, [_nan(p["summary"]["slo_attainment"]) for p in pts], "o-")
    ax.axhline(data["target_attainment"], color="red", lw=0.8, ls=":", label="target")
    if data["capacity_point"] is not None:
        ax.axvline(xs[data["capacity_point"]], color="green", lw=0.8, ls="--", label="capacity")
    ax.set_xlabel(label)
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    attainment = out / ATTAINMENT_PLOT
    fig.savefig(attainment, dpi=100)
    plt.close(fig)
    return [latency, attainment]


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"
