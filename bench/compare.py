"""Does disaggregation pay for this workload on this machine? Every deployment in turn,
the same seeded workloads at the same rates, one table of goodput under SLOs.

    python bench/compare.py [--model M] [--workloads long-short,short-long,chat]
                            [--deployments colocated,disagg,conditional,...]
                            [--rates 0.25,0.5] [--requests 24] [--slo-ttft-ms 3000]
                            [--slo-tpot-ms 400] [--local-max-stall-ms MS] [--out DIR]
                            [--json]

Deployments (the same total cores: each worker gets cores / workers torch threads):
- ``colocated``: 2 workers that prefill and decode (``tandem serve --colocated 2``);
- ``disagg``: 1 prefill + 1 decode worker, every prompt on the prefill pool;
- ``conditional``: 1 + 1, the router deciding per request (disaggregation.py);
- the same three with ``-prefix`` (``placement: prefix-aware``), and ``disagg-2x2``,
  ``conditional-2x2`` and their ``-prefix`` twins (2 + 2 workers, for prefix
  placement across two of each);
- ``conditional-unbounded`` / ``conditional-prefix-unbounded``: the rule without
  its stall budget (``local_max_stall_ms: 0``), to show what the budget
  (``--local-max-stall-ms``, the config's default unless given) changes;
- any of them with ``+KEY=VALUE`` appended (repeatable) for a setting of the
  router's ``disaggregation`` section, so that thresholds of the conditional rule
  run side by side: ``conditional-2x2+local_max_stall_ms=0+prefill_queue_max=1``.

Workloads (seeded; the same requests for every deployment):
- ``long-short``: 512-token prompts, 16-token answers (prefill-heavy);
- ``short-long``: 32-token prompts, 192-token answers (decode-heavy);
- ``chat``: 4 long system prompts (~400 tokens) shared by many users, each user a
  conversation of 3 turns whose every turn repeats its history, 32-token answers;
  sent as users would (``--multi-turn``): a turn goes once the previous one is
  answered, with the server's reply in the history.

Each (deployment, workload, rate) is one ``tandem bench load`` run (Poisson
arrivals, --requests measured after a warm-up: 2 requests, or the chat's first turn
of each system prompt), on requests of its own: the seed is --seed plus the rate's
index, so no run finds its prompts cached by an earlier one, and every deployment
gets the same requests at a given rate. Goodput counts requests that meet both SLOs
(TTFT, and TPOT, the mean inter-token latency of the request). The prefix hit rate
(of the prompt tokens looked up where they are computed, those found cached: each
request once) and the KV bytes moved per request come from the workers' ``Status``
counters after the warm-up and after the run; ``ceil`` is the hit rate one unbounded prefix cache
would reach on the chat requests as sent (``hit_ceiling``: what placement can hope
for); ``local`` is the share of requests prefilled on the decode worker. With
--out, ``compare.json`` and a plot of SLO
attainment against rate per workload are written there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import tempfile
from pathlib import Path

DEPLOYMENTS = {
    # name: (prefill workers, decode workers, disaggregation mode, placement)
    "colocated": (0, 2, "never", "least-loaded"),
    "colocated-prefix": (0, 2, "never", "prefix-aware"),
    "disagg": (1, 1, "always", "least-loaded"),
    "disagg-prefix": (1, 1, "always", "prefix-aware"),
    "conditional": (1, 1, "conditional", "least-loaded"),
    "conditional-prefix": (1, 1, "conditional", "prefix-aware"),
    "disagg-2x2": (2, 2, "always", "least-loaded"),
    "disagg-2x2-prefix": (2, 2, "always", "prefix-aware"),
    "conditional-2x2": (2, 2, "conditional", "least-loaded"),
    "conditional-2x2-prefix": (2, 2, "conditional", "prefix-aware"),
    "conditional-unbounded": (1, 1, "conditional", "least-loaded"),
    "conditional-prefix-unbounded": (1, 1, "conditional", "prefix-aware"),
}
WORKLOADS = ("long-short", "short-long", "chat")
# Warm-up requests of the synthetic workloads; the chat's are one per system prompt.
WARMUP = 2
CHAT_SYSTEMS = 4
STATUS_FIELDS = ("prefix_query_tokens", "prefix_hit_tokens", "shipped_prefix_query_tokens",
                 "shipped_prefix_hit_tokens", "kv_bytes_total")  # fmt: skip


def chat_dataset(path: Path, requests: int, seed: int, systems: int = CHAT_SYSTEMS) -> None:
    """JSONL of chats: ``systems`` long system prompts, users of 3 turns each, every
    turn carrying the conversation so far, in send order (the load run keeps it:
    ``in_order``). The assistant turns are filler text that a multi-turn run replaces
    with the replies it gets. The first ``systems`` lines, one user's first turn per
    system prompt, are the warm-up (``systems`` + ``requests`` lines in all): a
    service in its steady state has its system prompts cached."""
    from tandem.bench.load.datasets import WORDS

    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prompts = [f"You are assistant {i}. " + words(330) for i in range(systems)]
    warmup = [{"messages": [{"role": "system", "content": p},
                            {"role": "user", "content": f"warm-up user {i}: " + words(20)}],
               "output_len": 32} for i, p in enumerate(prompts)]  # fmt: skip
    lines, user = [], 0
    while len(lines) < requests:
        system = prompts[user % systems]
        history = [{"role": "system", "content": system}]
        for _turn in range(3):
            history.append({"role": "user", "content": f"user {user}: " + words(20)})
            lines.append({"messages": list(history), "output_len": 32})
            history.append({"role": "assistant", "content": words(24)})
        user += 1
    # Interleave users a little, keeping each user's turns in order.
    order = sorted(range(len(lines)), key=lambda i: (i // 3 // 2, i % 3, i // 3))
    with path.open("w") as f:
        for line in [*warmup, *(lines[i] for i in order[:requests])]:
            f.write(json.dumps(line) + "\n")


def hit_ceiling(
    sent, tokenizer, warmup: int, failed: frozenset[int] = frozenset(), block_size: int = 16
) -> float:
    """The prefix hit rate that one prefix cache of unbounded size would reach on the
    chats of ``sent`` (a load run's ``LoadResult.sent``) in their order: each
    request's prompt tokens in the full blocks that an earlier prompt began with, or
    that the turn it follows generated (its decode worker computed the reply, which
    this prompt repeats, re-encoded to the same tokens; not for a turn in ``failed``,
    whose follow-up carried the file's text), over its prompt tokens (the warm-up's
    requests count as earlier, not as looked up). What placement can hope for: a
    user's first turn finds only the system prompt, and a prompt's last block is not
    cached when partial, nor hit when whole (its last token is always computed)."""
    from tandem.bench.load.datasets import follow_ups

    seen: set[int] = set()
    found = looked = 0
    prompts = [tokenizer.encode_chat(spec.input_kwargs()["messages"]) for spec in sent]
    for i, (ids, link) in enumerate(zip(prompts, follow_ups(sent), strict=True)):
        keys, key = [], 0
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = hash((key, tuple(ids[start : start + block_size])))
            keys.append(key)
        if link is not None and link[0] not in failed:  # its prompt, all but its last output
            computed = len(prompts[link[0]]) + sent[link[0]].output_len - 1
            seen.update(keys[: computed // block_size])
        # The worker computes a prompt's last token whatever it holds (a prompt of whole
        # blocks can hit all but the last).
        usable = keys[: (len(ids) - 1) // block_size]
        hit = next((b for b, k in enumerate(usable) if k not in seen), len(usable))
        if i >= warmup:
            found += hit * block_size
            looked += len(ids)
        seen.update(keys)
    return found / looked if looked else math.nan


def _dataset(workload: str, tmp: Path, requests: int, seed: int):
    """(the DatasetConfig, the seed its run must use, its warm-up requests)."""
    from tandem.bench.load.datasets import LengthDist
    from tandem.bench.load.runner import DatasetConfig

    if workload == "long-short":
        lengths = LengthDist("fixed", 512), LengthDist("fixed", 16)
        return DatasetConfig(input_len=lengths[0], output_len=lengths[1]), seed, WARMUP
    if workload == "short-long":
        lengths = LengthDist("fixed", 32), LengthDist("fixed", 192)
        return DatasetConfig(input_len=lengths[0], output_len=lengths[1]), seed, WARMUP
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "chat.jsonl"
    chat_dataset(path, requests, seed, CHAT_SYSTEMS)
    dataset = DatasetConfig(kind="jsonl", path=str(path), in_order=True, multi_turn=True)
    return dataset, seed, CHAT_SYSTEMS


def _status_totals(cluster) -> dict[str, float]:
    """Sums of the counters over every worker, and requests served by decode workers."""
    from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc

    totals = dict.fromkeys((*STATUS_FIELDS, "decode_served"), 0)
    for p in cluster.processes:
        if p.name == "router":
            continue
        decode = p.name.startswith("decode")
        stub = worker_pb2_grpc.DecodeWorkerStub if decode else worker_pb2_grpc.PrefillWorkerStub
        with cluster.dial(p.ready["grpc"]) as ch:
            s = stub(ch).Status(worker_pb2.StatusRequest(), timeout=10)
        for name in STATUS_FIELDS:
            # KV bytes: counted once, where they arrive.
            if name != "kv_bytes_total" or decode:
                totals[name] += getattr(s, name)
        if decode:
            totals["decode_served"] += s.served
    # Where prompts were prefilled, counted by the router once per attempt that reserved
    # its blocks (the workers' prefilled_here counts those too, but served only the
    # requests that completed: a ratio of the two passed 100% when requests failed).
    from tandem.metrics.scrape import scrape, total

    router = scrape(cluster.metrics_targets()["router"])
    decisions = "tandem_router_prefill_decisions_total"
    totals["decisions"] = total(router, decisions)
    totals["decided_local"] = total(router, decisions, where="decode_worker")
    return totals


def _compute_hit_rate(d: dict[str, float]) -> float:
    """Of the prompt tokens looked up where they are computed, those found cached:
    each request once (a shipped prompt's lookup on its decode worker only decides
    which blocks are sent)."""
    query = d["prefix_query_tokens"] - d["shipped_prefix_query_tokens"]
    hit = d["prefix_hit_tokens"] - d["shipped_prefix_hit_tokens"]
    return hit / query if query else math.nan


def run_point(cluster, dataset, rate: float, args, tokenizer=None) -> dict:
    """``dataset``: (DatasetConfig, seed, warm-up), from ``_dataset``; with
    ``tokenizer``, the run's chats' ``hit_ceiling`` too (else nan). The workers'
    counters are read after the warm-up and after the run."""
    from tandem.bench.load.metrics import SLO
    from tandem.bench.load.runner import LoadConfig, run

    dataset, seed, warmup = dataset
    before: dict[str, float] = {}
    result = run(LoadConfig(
        target=cluster.address, request_rate=rate, num_requests=args.requests, seed=seed,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), dataset=dataset,
        progress=False, timeout_s=args.timeout, num_warmup=warmup,
    ), before_measured=lambda: before.update(_status_totals(cluster)))  # fmt: skip
    after = _status_totals(cluster)
    d = {k: after[k] - before[k] for k in after}
    s = result.summary
    served = max(1, d["decode_served"])
    return dict(
        rate=rate,
        completed=s.completed,
        failed=s.failed,
        goodput=s.goodput,
        slo_attainment=s.slo_attainment,
        ttft_p50=s.ttft_ms.median,
        ttft_p99=s.ttft_ms.p99,
        itl_p50=s.itl_ms.median,
        itl_p99=s.itl_ms.p99,
        tpot_p50=s.tpot_ms.median,
        hit_rate=_compute_hit_rate(d),
        kv_mib_per_request=d["kv_bytes_total"] / served / 2**20,
        local=d["decided_local"] / d["decisions"] if d["decisions"] else math.nan,
        hit_ceiling=math.nan
        if tokenizer is None
        else hit_ceiling(
            result.sent,
            tokenizer,
            warmup,
            frozenset(warmup + r.index for r in result.records if not r.ok),
        ),  # fmt: skip
    )


def parse_deployment(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME[+KEY=VALUE...]`` -> (a DEPLOYMENTS name, disaggregation settings); raises
    ValueError naming what is wrong."""
    from tandem.config import DisaggregationConfig
    from tandem.errors import ConfigError

    name, *settings = spec.split("+")
    if name not in DEPLOYMENTS:
        raise ValueError(f"{name!r} is not one of {', '.join(DEPLOYMENTS)}")
    numeric = {f.name for f in dataclasses.fields(DisaggregationConfig) if f.name != "mode"}
    overrides: dict[str, float] = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        if key not in numeric:
            raise ValueError(
                f"{spec!r}: {key!r} is not a disaggregation setting ({', '.join(sorted(numeric))})"
            )
        try:
            overrides[key] = int(value)
        except ValueError:
            try:
                overrides[key] = float(value)
            except ValueError:
                raise ValueError(f"{spec!r}: {key} must be a number, got {value!r}") from None
    try:
        DisaggregationConfig(**overrides)
    except ConfigError as exc:
        raise ValueError(f"{spec!r}: {exc}") from None
    return name, overrides


def _cluster_config(spec: str, args):
    from tandem.config import DisaggregationConfig, EngineConfig, RouterConfig
    from tandem.deploy.local import ClusterConfig

    name, overrides = parse_deployment(spec)
    prefill, decode, mode, placement = DEPLOYMENTS[name]
    if name.endswith("-unbounded"):
        overrides = {"local_max_stall_ms": 0, **overrides}
    elif args.local_max_stall_ms is not None:
        overrides = {"local_max_stall_ms": args.local_max_stall_ms, **overrides}
    disaggregation = DisaggregationConfig(mode=mode, **overrides)
    return ClusterConfig(
        num_prefill=prefill,
        num_decode=decode,
        engine=EngineConfig(model=args.model),
        router=RouterConfig(
            port=0, placement=placement, disaggregation=disaggregation, metrics_port=0
        ),  # for its prefill decisions
        threads_per_worker=args.threads,
    )


def table(rows: list[dict]) -> str:
    width = max([28, *(len(r["deployment"]) for r in rows)])
    head = (f"{'workload':<11} {'deployment':<{width}} {'rate':>5} {'goodput':>8} {'SLO%':>5} "
            f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'hit':>5} {'ceil':>5} "
            f"{'KV MiB/req':>10} {'local':>6} {'fail':>4}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<11} {r['deployment']:<{width}} {r['rate']:>5g} {r['goodput']:>8.3f} "
            f"{100 * r['slo_attainment']:>5.0f} {r['ttft_p50']:>9.0f} {r['ttft_p99']:>7.0f} "
            f"{r['itl_p50']:>8.0f} {r['itl_p99']:>7.0f} {_pct(r['hit_rate']):>5} "
            f"{_pct(r['hit_ceiling']):>5} "
            f"{r['kv_mib_per_request']:>10.2f} {_pct(r['local']):>6} {r['failed']:>4}"
        )
    return "\n".join(lines)


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{100 * v:.0f}%"


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows}, key=WORKLOADS.index)
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        for dep in dict.fromkeys(r["deployment"] for r in rows if r["workload"] == w):
            pts = [r for r in rows if r["workload"] == w and r["deployment"] == dep]
            ax.plot([p["rate"] for p in pts], [100 * p["slo_attainment"] for p in pts],
                    marker="o", label=dep)  # fmt: skip
        ax.set(title=w, xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "slo_attainment.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--deployments", default="colocated,disagg,conditional")
    p.add_argument("--rates", default="0.25,0.5", help="requests/s, each a load run")
    p.add_argument("--requests", type=int, default=24, help="measured requests per run")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=400.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--local-max-stall-ms", type=float, default=None,
                   help="conditional deployments' stall budget (default: config's)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write compare.json and the plot here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    deployments = [d for d in args.deployments.split(",") if d]
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    for d in deployments:
        try:
            parse_deployment(d)
        except ValueError as exc:
            p.error(f"--deployments: {exc}")
    rates = [float(r) for r in args.rates.split(",")]

    from tandem.deploy.local import LocalCluster
    from tandem.engine.loader import resolve_model
    from tandem.engine.tokenizer import Tokenizer

    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-compare-") as tmp:
        # One dataset per (workload, rate), the same for every deployment: a run must not
        # find its prompts in the prefix cache because an earlier rate sent them.
        datasets = {
            (w, rate): _dataset(w, Path(tmp) / f"{w}-{i}", args.requests, args.seed + i)
            for w in workloads
            for i, rate in enumerate(rates)
        }
        # What a chat run's hit rate is to be read against.
        tokenizer = None
        if "chat" in workloads:
            tokenizer = Tokenizer.from_pretrained(resolve_model(args.model))
        for dep in deployments:
            cfg = _cluster_config(dep, args)
            print(f"{dep}: {cfg.num_prefill} prefill + {cfg.num_decode} decode workers, "
                  f"starting ...", file=sys.stderr)  # fmt: skip
            with LocalCluster(cfg) as cluster:
                for w in workloads:
                    for rate in rates:
                        point = run_point(cluster, datasets[w, rate], rate, args,
                                          tokenizer if w == "chat" else None)  # fmt: skip
                        rows.append(dict(deployment=dep, workload=w, **point))
                        print(f"  {w} at {rate:g}/s: goodput {point['goodput']:.3f}/s, "
                              f"TTFT p50 {point['ttft_p50']:.0f} ms", file=sys.stderr)  # fmt: skip
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), r["rate"]))
    result = dict(
        model=args.model,
        slo=dict(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        requests=args.requests,
        rows=rows,
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out / 'compare.json'} and {plot(rows, out)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}; SLOs: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= "
            f"{args.slo_tpot_ms:g} ms; {args.requests} requests per run; goodput in req/s"
        )
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
