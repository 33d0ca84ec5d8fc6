"""How fast a worker answers Status (the router's liveness and load signal) while its
engine is saturated, side by side with the same worker idle, in one run.

    python bench/status_latency.py [--model M] [--streams 16] [--calls 200] [--json]

Starts a `tandem serve`-style cluster (1 prefill + 1 decode worker on loopback),
times --calls Status calls to each worker while idle, then again while --streams
greedy streams (prompts of ~200 tokens, 256 output tokens, EOS ignored) keep both
engines busy. One channel per worker, reused, as the router's is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time


def _times(stub, request, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        stub.Status(request, timeout=30)
        out.append(time.perf_counter() - start)
        time.sleep(0.01)
    return out


def _pct(samples: list[float], q: float) -> float:
    """The nearest-rank percentile, in ms: the smallest sample with at least ``q`` of
    them at or below it (it took the next one up: p99 of 100 samples was the largest)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
    from tandem.client import TandemClient
    from tandem.config import EngineConfig
    from tandem.deploy.local import ClusterConfig, LocalCluster

    base = ClusterConfig(engine=EngineConfig(model=args.model))
    config = dataclasses.replace(base, router=dataclasses.replace(base.router, port=0))
    request = worker_pb2.StatusRequest()
    result: dict = {"model": args.model, "streams": args.streams, "calls": args.calls}
    with LocalCluster(config) as c:
        stubs = {}
        for proc in c.processes:
            if proc.name == "router":
                continue
            channel = c.dial(proc.ready["grpc"])
            cls = (worker_pb2_grpc.PrefillWorkerStub if proc.name.startswith("prefill")
                   else worker_pb2_grpc.DecodeWorkerStub)  # fmt: skip
            stubs[proc.name] = cls(channel)
        idle = {name: _times(stub, request, args.calls) for name, stub in stubs.items()}

        stop = threading.Event()

        def stream(i: int) -> None:
            prompt = f"Story {i}: " + "tell me about the sea and the lighthouse. " * 20
            with TandemClient(c.address, timeout=600) as client:
                while not stop.is_set():
                    for _ in client.generate(prompt=prompt, max_tokens=256, ignore_eos=True):
                        if stop.is_set():
                            break

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        time.sleep(5.0)  # every stream admitted and decoding
        busy, running = {}, {}
        for name, stub in stubs.items():
            running[name] = stub.Status(request, timeout=30).running
            busy[name] = _times(stub, request, args.calls)
        stop.set()
        for t in threads:
            t.join()
    for name in stubs:
        result[name] = {
            "idle_ms": {"p50": _pct(idle[name], 0.5), "p99": _pct(idle[name], 0.99)},
            "busy_ms": {
                "p50": _pct(busy[name], 0.5),
                "p99": _pct(busy[name], 0.99),
                "max": max(busy[name]) * 1e3,
            },  # fmt: skip
            "running_when_busy": running[name],
            "p99_ratio": _pct(busy[name], 0.99) / _pct(idle[name], 0.99),
        }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Status latency, {args.calls} calls per worker, {args.model}, "
          f"{args.streams} streams when busy")  # fmt: skip
    print(f"{'worker':<11}{'idle p50':>10}{'idle p99':>10}{'busy p50':>10}{'busy p99':>10}"
          f"{'busy max':>10}{'p99 ratio':>11}{'running':>9}")  # fmt: skip
    for name in stubs:
        r = result[name]
        print(f"{name:<11}{r['idle_ms']['p50']:>10.2f}{r['idle_ms']['p99']:>10.2f}"
              f"{r['busy_ms']['p50']:>10.2f}{r['busy_ms']['p99']:>10.2f}{r['busy_ms']['max']:>10.2f}"
              f"{r['p99_ratio']:>11.1f}{r['running_when_busy']:>9}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
