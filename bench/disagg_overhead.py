"""What disaggregation costs one request: TTFT and end-to-end latency through
`tandem serve` (1 prefill + 1 decode worker) vs the colocated engine, side by side
in one run, with the KV transfer time shown separately.

    python bench/disagg_overhead.py [--model M] [--prompt-len 512] [--output-len 64]
                                    [--runs 5] [--json]

Same model, same prompt token ids (plain text, no template), greedy, EOS ignored.
Each side is warmed up once, then the median of --runs is reported. On one host
the cluster pays for the gRPC hops, the KV transfer (UCX over loopback) and
processes sharing the cores; the colocated engine pays none of these.

Where the KV transfer shows: the prefill worker streams the first token before
it ships any KV, so the transfer is not in TTFT; the decode worker starts once
the KV is there, so what the transfer does not overlap shows as a longer wait
for the second token. The script reports that wait (first gap) next to the
stream's median inter-token latency: their difference is the exposed part of
the transfer, and its share of TTFT is the figure to keep small.

Three clusters run side by side: one as `tandem serve` starts it (mutual TLS
between the router and the workers, authenticated KV connections, the KV
shipped layer by layer as the prefill computes it), one with ``cluster:
{insecure: true}`` (plaintext inside) and one with ``prefill: {kv_layerwise:
false}`` (the KV shipped whole after the prompt). Requests alternate between
them and the colocated engine, one at a time (an idle cluster or engine takes no
CPU to speak of), so that all see the same machine; the TLS column is what
security inside costs (secure / plaintext), the last line what layer-wise
shipping hides.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def _colocated(engine, prompt_ids, output_len) -> tuple[float, float, float, float]:
    """One request through the colocated engine (see ``_timed``)."""
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.stream(prompt_ids, params)
    return _timed(start, (time.perf_counter() for _ in outputs))


def _timed(start: float, arrivals) -> tuple[float, float, float, float]:
    """(TTFT, end-to-end, first gap, median later gap) in seconds, from the arrival
    times of a stream's outputs (one token each)."""
    t = list(arrivals)
    gaps = [b - a for a, b in zip(t[1:], t[2:], strict=False)]
    return t[0] - start, t[-1] - start, t[1] - t[0], statistics.median(gaps)


def _one(client, prompt, output_len) -> tuple[float, float, float, float]:
    """One request through a cluster (see ``_timed``)."""
    start = time.perf_counter()
    stream = client.generate(prompt=prompt, max_tokens=output_len, temperature=0, ignore_eos=True)
    return _timed(start, (time.perf_counter() for _ in stream))


def _prefill_transfer_totals(cluster) -> tuple[float, int, int]:
    """Cumulative KV transfer seconds, bytes and count of the prefill worker(s)."""
    from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc

    seconds = nbytes = requests = 0
    for p in cluster.processes:
        if p.name.startswith("prefill"):
            with cluster.dial(p.ready["grpc"]) as ch:
                s = worker_pb2_grpc.PrefillWorkerStub(ch).Status(worker_pb2.StatusRequest())
            seconds += s.kv_transfer_seconds_total
            nbytes += s.kv_bytes_total
            requests += s.kv_transfers_total
    return seconds, nbytes, requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from tandem.config import ClusterSecurityConfig, EngineConfig, PrefillConfig, RouterConfig
    from tandem.deploy.local import ClusterConfig, LocalCluster
    from tandem.engine.engine import LLMEngine

    # Prompts from the vocabulary's plain range; text round-trips for the cluster side.
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    rng = random.Random(0)
    ids = [rng.randrange(1000, engine.model_config.vocab_size) for _ in range(args.prompt_len)]
    prompt = engine.tokenizer.decode(ids)
    prompt_ids = engine.tokenizer.encode(prompt)
    print(f"colocated: {len(prompt_ids)} prompt tokens ...", file=sys.stderr)
    _colocated(engine, prompt_ids, args.output_len)  # warm-up

    import contextlib

    from tandem.client import TandemClient

    print("clusters (secure, plaintext inside, KV whole): 1 prefill + 1 decode worker each ...",
          file=sys.stderr)  # fmt: skip
    clusters, clients, samples, before = {}, {}, {}, {}
    with contextlib.ExitStack() as stack:
        secure, plaintext = ClusterSecurityConfig(), ClusterSecurityConfig(insecure=True)
        for name, security, layerwise in (("secure", secure, True),
                                          ("plaintext", plaintext, True),
                                          ("whole", secure, False)):  # fmt: skip
            cfg = ClusterConfig(
                engine=EngineConfig(model=args.model, enable_prefix_caching=False),
                router=RouterConfig(port=0),
                prefill=PrefillConfig(kv_layerwise=layerwise),
                cluster=security,
            )
            clusters[name] = stack.enter_context(LocalCluster(cfg))
            clients[name] = stack.enter_context(TandemClient(clusters[name].address, timeout=600))
            _one(clients[name], prompt, args.output_len)  # warm-up
            before[name] = _prefill_transfer_totals(clusters[name])
            samples[name] = []
        colocated = []
        for _ in range(args.runs):  # the colocated engine's turn too, idle in between
            colocated.append(_colocated(engine, prompt_ids, args.output_len))
            for name, client in clients.items():
                samples[name].append(_one(client, prompt, args.output_len))
        transfer = {}
        for name, cluster in clusters.items():
            after = _prefill_transfer_totals(cluster)
            n = after[2] - before[name][2]
            transfer[name] = (
                (after[0] - before[name][0]) / n * 1e3 if n else float("nan"),
                (after[1] - before[name][1]) / n / 2**20 if n else float("nan"),
            )
    remote, plain, whole = samples["secure"], samples["plaintext"], samples["whole"]
    transfer_ms, kv_mib = transfer["secure"]

    def med(samples, i):
        return statistics.median(s[i] for s in samples) * 1e3

    result = {
        "model": args.model,
        "prompt_tokens": len(prompt_ids),
        "output_tokens": args.output_len,
        "colocated_ttft_ms": round(med(colocated, 0), 1),
        "cluster_ttft_ms": round(med(remote, 0), 1),
        "plaintext_ttft_ms": round(med(plain, 0), 1),
        "ttft_ratio": round(med(remote, 0) / med(colocated, 0), 3),
        "tls_ttft_ratio": round(med(remote, 0) / med(plain, 0), 3),
        "colocated_e2e_ms": round(med(colocated, 1), 1),
        "cluster_e2e_ms": round(med(remote, 1), 1),
        "plaintext_e2e_ms": round(med(plain, 1), 1),
        "e2e_ratio": round(med(remote, 1) / med(colocated, 1), 3),
        "tls_e2e_ratio": round(med(remote, 1) / med(plain, 1), 3),
        "colocated_first_gap_ms": round(med(colocated, 2), 1),
        "cluster_first_gap_ms": round(med(remote, 2), 1),
        "cluster_itl_ms": round(med(remote, 3), 1),
        # What the transfer adds to the stream that nothing hid: the wait for the
        # second token beyond an ordinary inter-token gap (the first token waits for none).
        "kv_exposed_ms": round(max(0.0, med(remote, 2) - med(remote, 3)), 1),
        "kv_exposed_share_of_ttft": round(
            max(0.0, med(remote, 2) - med(remote, 3)) / med(remote, 0), 4
        ),
        # The same cluster shipping the KV whole, after the prompt (kv_layerwise: false).
        "whole_ttft_ms": round(med(whole, 0), 1),
        "whole_first_gap_ms": round(med(whole, 2), 1),
        "whole_kv_exposed_ms": round(max(0.0, med(whole, 2) - med(whole, 3)), 1),
        "whole_kv_transfer_ms": round(transfer["whole"][0], 2),
        "kv_transfer_ms": round(transfer_ms, 2),
        "plaintext_kv_transfer_ms": round(transfer["plaintext"][0], 2),
        "kv_mib_per_request": round(kv_mib, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        head = ("colocated", "cluster 1+1", "ratio", "no TLS inside", "TLS cost")
        print(f"{'':<16} {head[0]:>10} {head[1]:>12} {head[2]:>6} {head[3]:>14} {head[4]:>9}")
        for key, label in (("ttft", "TTFT ms"), ("e2e", "end-to-end ms")):
            c, r = result[f"colocated_{key}_ms"], result[f"cluster_{key}_ms"]
            p = result[f"plaintext_{key}_ms"]
            print(f"{label:<16} {c:>10.1f} {r:>12.1f} {r / c:>6.2f} {p:>14.1f} {r / p:>9.3f}")
        c, r = result["colocated_first_gap_ms"], result["cluster_first_gap_ms"]
        print(f"{'1st -> 2nd ms':<16} {c:>10.1f} {r:>12.1f} {r / c:>6.2f}"
              f"   (cluster ITL after it: {result['cluster_itl_ms']:.1f} ms)")  # fmt: skip
        plain_ms = result["plaintext_kv_transfer_ms"]
        print(
            f"{'KV send->ack ms':<16} {'':>10} {transfer_ms:>12.2f} {'':>6} {plain_ms:>14.2f}"
            f"   ({kv_mib:.1f} MiB/request; layer by layer the first layer leaves as the"
            f" prefill begins, so this spans the prefill)"
        )
        print(
            f"KV transfer in TTFT: none (the first token leaves before the KV); exposed on "
            f"the second token: {result['kv_exposed_ms']:.1f} ms layer by layer, "
            f"{100 * result['kv_exposed_share_of_ttft']:.1f}% of TTFT; "
            f"{result['whole_kv_exposed_ms']:.1f} ms shipped whole after the prompt "
            f"(TTFT {result['whole_ttft_ms']:.1f} ms, 1st -> 2nd {result['whole_first_gap_ms']:.1f}"
            f" ms, transfer {result['whole_kv_transfer_ms']:.2f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
