"""The same cluster through both of its APIs: gRPC (the baseline) against the
OpenAI-compatible HTTP API, one harness, the same seeded requests.

    python bench/api_compare.py [--model M] [--requests 16] [--concurrency 4]
                                [--input-len 128] [--output-len 64] [--rounds 2] [--json]

Starts one local cluster (1 prefill + 1 decode worker, the router with
``http_port``, prefix caching off so that repeated prompts cost the same), then
runs ``tandem bench load`` against it ``--rounds`` times per API, alternating
(grpc, openai, grpc, openai, ...) so that drift on a shared machine falls on
both. Prints per API the completed requests and output tokens
(which must be equal) and the medians over rounds of TTFT, ITL and end-to-end
p50/p99, with the HTTP/gRPC ratio. The HTTP path counts each server-sent event
with text as one token arriving; the gRPC path has token ids per response.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from tandem.bench.load.datasets import LengthDist
    from tandem.bench.load.runner import DatasetConfig, LoadConfig, run
    from tandem.config import EngineConfig, RouterConfig
    from tandem.deploy.local import ClusterConfig, LocalCluster

    # No prefix cache: every run sends the same prompts, and a later run must not find
    # them cached by an earlier one.
    engine = EngineConfig(model=args.model, enable_prefix_caching=False)
    config = ClusterConfig(engine=engine, router=RouterConfig(port=0, http_port=0))
    dataset = DatasetConfig(
        input_len=LengthDist.parse(args.input_len, "--input-len"),
        output_len=LengthDist.parse(args.output_len, "--output-len"),
    )
    runs: dict[str, list] = {"grpc": [], "openai": []}
    with LocalCluster(config) as cluster:
        targets = {"grpc": cluster.address, "openai": f"http://{cluster.http_address}"}
        base = LoadConfig(target="", num_requests=args.requests, max_concurrency=args.concurrency,
                          dataset=dataset, progress=False)  # fmt: skip
        for r in range(args.rounds):
            for api in ("grpc", "openai"):
                load = dataclasses.replace(base, target=targets[api], api=api, seed=r)
                summary = run(load).summary
                runs[api].append(summary)
                print(f"round {r + 1} {api}: {summary.completed} ok, TTFT p50 "
                      f"{summary.ttft_ms.median:.0f} ms", file=sys.stderr, flush=True)  # fmt: skip

    def med(api: str, metric: str, stat: str) -> float:
        return statistics.median(getattr(getattr(s, metric), stat) for s in runs[api])

    rows = []
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        for stat in ("median", "p99"):
            g, h = med("grpc", metric, stat), med("openai", metric, stat)
            rows.append((f"{metric[:-3].upper()} {'p50' if stat == 'median' else 'p99'} ms",
                         g, h, h / g if g else float("nan")))  # fmt: skip
    counts = {api: (sum(s.completed for s in runs[api]), sum(s.output_tokens for s in runs[api]))
              for api in runs}  # fmt: skip
    if args.json:
        print(json.dumps({"counts": counts, "rows": rows}, indent=2))
        return 0
    print(
        f"{args.model}: {args.requests} requests x {args.rounds} rounds per API, "
        f"concurrency {args.concurrency}, input {args.input_len}, output {args.output_len}"
    )
    for api, (done, tokens) in counts.items():
        print(f"  {api:7} {done} completed, {tokens} output tokens")
    print(f"{'':16} {'grpc':>9} {'openai':>9} {'ratio':>7}")
    for name, g, h, ratio in rows:
        print(f"{name:16} {g:9.1f} {h:9.1f} {ratio:7.2f}")
    return 0 if counts["grpc"] == counts["openai"] else 1


if __name__ == "__main__":
    sys.exit(main())
