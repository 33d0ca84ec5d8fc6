"""What a decode worker's death costs a stream: the time from the SIGKILL to the
first token the router migrates to another worker, side by side with the same
stream's own inter-token latency before the kill (the ratio is the stall a client
sees, in tokens' worth of waiting).

    python bench/migration.py [--model M] [--kills 10] [--max-tokens 160]
                              [--kill-after 48] [--json]

Each kill gets a fresh `tandem serve`-style cluster (1 prefill + 2 decode workers
on loopback): one greedy stream (chat prompt, EOS ignored) runs until it has
--kill-after tokens, the decode worker serving it is frozen until the client has
read every token it sent, then SIGKILLed (so the clock starts at the death and
the next token is the migrated attempt's), and the stream
goes on through a migration (the prompt plus the tokens already streamed are
re-prefilled). Two short requests first let both decode workers serve once, so
the prefill worker's KV links to them are up, as in a cluster in use (a first
connection costs a UCX set-up). Every stream's text is checked against an undisturbed run of the
same request. The figure is the median over the kills; the baseline is the median
inter-token gap of the streams before their kill.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import threading
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _stream(address: str, max_tokens: int, kill_after: int | None = None, cluster=None):
    """(tokens, text, token arrival times, kill time or None).

    With ``kill_after``: once that many tokens have arrived, the decode worker serving
    the stream is frozen (SIGSTOP) until every token it already sent has been read,
    then killed; so the first token after the kill is the migrated attempt's.
    """
    from tandem.client import TandemClient

    tokens: list[int] = []
    text: list[str] = []
    times: list[float] = []
    killed_at: list[float] = []

    def read() -> None:
        with TandemClient(address, timeout=600) as client:
            for chunk in client.generate(
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
            ):
                now = time.perf_counter()
                times.extend([now] * len(chunk.token_ids))
                tokens.extend(chunk.token_ids)
                text.append(chunk.text)

    reader = threading.Thread(target=read)
    reader.start()
    if kill_after is not None:
        while len(tokens) < kill_after and reader.is_alive():
            time.sleep(0.001)
        victim = _serving_decode_worker(cluster)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(1.0)  # whatever it sent before it froze is read by now
        os.kill(victim, signal.SIGKILL)
        killed_at.append(time.perf_counter())
    reader.join()
    return tokens, "".join(text), times, killed_at[0] if killed_at else None


def _serving_decode_worker(cluster) -> int:
    from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc

    for proc in cluster.processes:
        if not proc.name.startswith("decode"):
            continue
        with cluster.dial(proc.ready["grpc"]) as channel:
            status = worker_pb2_grpc.DecodeWorkerStub(channel).Status(
                worker_pb2.StatusRequest(), timeout=10
            )
        if status.running:
            return proc.popen.pid
    raise RuntimeError("no decode worker was running the stream")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kill-after", type=int, default=48)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if not 1 <= args.kill_after < args.max_tokens:
        p.error("--kill-after must be in [1, --max-tokens)")

    from tandem.config import EngineConfig
    from tandem.deploy.local import ClusterConfig, LocalCluster

    base = ClusterConfig(num_prefill=1, num_decode=2, engine=EngineConfig(model=args.model))
    config = dataclasses.replace(base, router=dataclasses.replace(base.router, port=0))

    def cluster() -> LocalCluster:
        return LocalCluster(config)

    with cluster() as c:
        reference, ref_text, _, _ = _stream(c.address, args.max_tokens, None)
    gaps, itls, exact = [], [], 0
    for i in range(args.kills):
        with cluster() as c:
            for _ in range(2):  # both decode workers serve once: KV links are up, as in use
                _stream(c.address, 2)
            tokens, text, times, killed_at = _stream(c.address, args.max_tokens, args.kill_after, c)
        before = sorted({t for t in times if t <= killed_at})  # one time per response
        after = [t for t in times if t > killed_at]
        gaps.append(after[0] - killed_at)
        itls.append(statistics.median(b - a for a, b in zip(before, before[1:], strict=False)))
        exact += tokens == reference and text == ref_text
        if not args.json:
            same = "same" if tokens == reference and text == ref_text else "DIFFERENT"
            print(
                f"kill {i + 1:2}: first migrated token {gaps[-1] * 1e3:7.1f} ms after the kill "
                f"(inter-token before it {itls[-1] * 1e3:.1f} ms); {same} text",
                file=sys.stderr,
            )
    gap, itl = statistics.median(gaps), statistics.median(itls)
    result = {
        "model": args.model,
        "kills": args.kills,
        "kill_after_tokens": args.kill_after,
        "death_to_first_migrated_token_ms": {
            "median": gap * 1e3,
            "min": min(gaps) * 1e3,
            "max": max(gaps) * 1e3,
        },  # fmt: skip
        "inter_token_ms_median": itl * 1e3,
        "ratio": gap / itl,
        "exact_streams": exact,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"death -> first migrated token: median {gap * 1e3:.0f} ms "
            f"(min {min(gaps) * 1e3:.0f}, max {max(gaps) * 1e3:.0f}) over {args.kills} kills"
        )
        print(f"inter-token latency before the kill: median {itl * 1e3:.1f} ms")
        print(f"ratio: {gap / itl:.1f}x one inter-token gap; "
              f"{exact}/{args.kills} streams equal to the undisturbed run")  # fmt: skip
    return 0 if exact == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
