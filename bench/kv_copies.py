"""The two copies of a KV transfer, gather (sender) and scatter (receiver), run by run
against one indexed copy over the blocks dim, next to a memcpy of the same bytes.

    python bench/kv_copies.py [--blocks 46] [--iters 30] [--threads 1] [--json]

One request's KV for SmolLM2-135M (30 layers, K and V, 16 tokens x 3 heads x 64,
bfloat16; 46 blocks is 16 MiB) in a 1,000-block cache, its blocks in 1, 4, 16 or
--blocks runs of consecutive ids (a fresh pool hands out one run; a busy one
fewer, longer runs than blocks). ``tandem/kv_transfer/payload.py`` copies run by
run up to MAX_SLICE_RUNS runs and with ``index_select`` / ``index_copy_`` past
that, which were the only copies before. Median of --iters, in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _median_ms(fn, iters: int) -> float:
    fn()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out) * 1e3


def _ids(n: int, runs: int) -> list[int]:
    """``n`` block ids in ``runs`` runs of consecutive ids, with gaps between them."""
    ids, start = [], 7
    for r in range(runs):
        length = n // runs + (r < n % runs)
        ids += range(start, start + length)
        start += length + 5
    return ids


def _row(kv: torch.Tensor, buf: torch.Tensor, runs: int, ids: list[int], iters: int) -> dict:
    from tandem.kv_transfer import payload
    from tandem.kv_transfer.payload import gather, scatter

    index = torch.tensor(ids)
    return dict(
        runs=runs,
        copy="slices" if payload._runs(ids) is not None else "indexed",
        gather_indexed_ms=_median_ms(lambda: torch.index_select(kv, 2, index, out=buf), iters),
        gather_ms=_median_ms(lambda: gather(kv, ids, (0, 30), out=buf), iters),
        scatter_indexed_ms=_median_ms(lambda: kv.index_copy_(2, index, buf), iters),
        scatter_ms=_median_ms(lambda: scatter(kv, ids, (0, 30), buf), iters),
    )


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=46)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker has 1-2)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    kv = torch.randn(30, 2, 1001, 16, 3, 64).to(torch.bfloat16)
    n = args.blocks
    buf = torch.empty((30, 2, n, 16, 3, 64), dtype=torch.bfloat16)
    nbytes = buf.numel() * buf.element_size()
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    memcpy = _median_ms(lambda: dst.copy_(src), args.iters)
    rows = [_row(kv, buf, runs, _ids(n, runs), args.iters) for runs in sorted({1, 4, 16, n})]
    if args.json:
        print(json.dumps({"bytes": nbytes, "memcpy_ms": memcpy, "rows": rows}))
        return 0
    print(f"{nbytes / 2**20:.1f} MiB per request; memcpy of the same bytes {memcpy:.2f} ms")
    print(f"{'runs':>5} {'copy':>8} {'gather ms':>10} {'indexed':>8} {'ratio':>6} "
          f"{'scatter ms':>11} {'indexed':>8} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['runs']:>5} {r['copy']:>8} {r['gather_ms']:>10.2f} {r['gather_indexed_ms']:>8.2f}"
            f" {r['gather_indexed_ms'] / r['gather_ms']:>6.2f} {r['scatter_ms']:>11.2f}"
            f" {r['scatter_indexed_ms']:>8.2f} {r['scatter_indexed_ms'] / r['scatter_ms']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
