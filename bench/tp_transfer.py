"""KV transfer between tensor-parallel workers of different widths against the same
width, side by side in one run, over the UCX backend (one process, both read paths).

    python bench/tp_transfer.py [--layers 30] [--kv-heads 3] [--head-dim 64]
                                [--tokens 512] [--widths 3:3,3:1,1:3,1:1] [--iters 10]
                                [--json]

One request of ``--tokens`` tokens (SmolLM2-135M's KV geometry by default, bfloat16)
goes from a sender cache of width P to a receiver cache of width D, all layers in one
``send``, ``--iters`` times; the time is from ``send`` to the sender's future resolving
(the receiver read and verified every block and acked). Between equal widths a
message is a plain block copy; between different widths the receiver re-splits each
sender rank's heads (tandem/kv_transfer/heads.py): a strided copy per slice of heads
from a mapped cache ("mapped"), or one UCX get per token row and slice of heads
("get", the path across hosts, and between tensor-parallel workers on one host, whose
shared caches UCX cannot map). Each line's ratio is to the first width pair's time on
the same path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def _fingerprint(args, ranks: int):
    from tandem.kv_transfer.base import Fingerprint

    return Fingerprint(
        model="bench",
        dtype="bfloat16",
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=16,
        tensor_parallel_size=ranks,
    )


def _cache(args, ranks: int, blocks: int, mapped: bool):
    import torch

    from tandem.kv_transfer.heads import kv_head_slice
    from tandem.kv_transfer.ucx.rma import allocate_kv

    heads = kv_head_slice(0, ranks, args.kv_heads)
    shape = (ranks * args.layers, 2, blocks + 1, 16, heads.stop - heads.start, args.head_dim)
    if mapped:
        return allocate_kv(shape, torch.bfloat16, torch.device("cpu"))
    return torch.zeros(shape, dtype=torch.bfloat16)


def measure(args, src: int, dst: int, path: str) -> dict:
    import torch

    from tandem.kv_transfer import make_receiver, make_sender

    blocks = -(-args.tokens // 16)
    mapped = path == "mapped"
    sender_kv, receiver_kv = _cache(args, src, blocks, mapped), _cache(args, dst, blocks, mapped)
    sender_kv.copy_(torch.randn(sender_kv.shape, dtype=torch.bfloat16))
    receiver = make_receiver("ucx", receiver_kv, _fingerprint(args, dst), map_peers=mapped)
    sender = make_sender("ucx", sender_kv, _fingerprint(args, src))
    ids = tuple(range(blocks))
    times = []
    try:
        for i in range(args.iters + 1):  # the first connects: not counted
            dest = receiver.expect(f"r{i}", ids, lease_s=60)
            started = time.perf_counter()
            status = sender.send(dest, ids, first_token=1).result(timeout=120)
            took = time.perf_counter() - started
            arrived = receiver.poll(f"r{i}")
            receiver.release(f"r{i}")
            if i:
                times.append(took)
    finally:
        sender.close()
        receiver.close()
    seconds = statistics.median(times)
    return {
        "widths": f"{src}:{dst}",
        "path": path,
        "ms": seconds * 1e3,
        "bytes": arrived.bytes,
        "gb_s": arrived.bytes / seconds / 1e9,
        "state": status.state.value,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--widths", default="3:3,3:1,1:3,1:1", help="sender:receiver pairs")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tandem.kv_transfer.ucx.runtime import ucx_env_defaults

    ucx_env_defaults()
    pairs = [tuple(int(w) for w in p.split(":")) for p in args.widths.split(",")]
    rows = []
    for path in ("mapped", "get"):
        base = None
        for src, dst in pairs:
            row = measure(args, src, dst, path)
            base = base or row["ms"]
            row["ratio"] = row["ms"] / base
            rows.append(row)
            print(f"  {path} {src}:{dst} done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"one request of {args.tokens} tokens, {args.layers} layers, {args.kv_heads} KV heads")
    print(f"{'path':<8}{'widths':>8}{'ms':>10}{'GB/s':>8}{'MB':>8}{'x first pair':>14}")
    for r in rows:
        print(
            f"{r['path']:<8}{r['widths']:>8}{r['ms']:>10.2f}{r['gb_s']:>8.2f}"
            f"{r['bytes'] / 1e6:>8.1f}{r['ratio']:>14.2f}"
        )


if __name__ == "__main__":
    main()
