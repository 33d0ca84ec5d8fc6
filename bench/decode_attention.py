"""Decode attention on CPU: the torch backend's batched matmuls vs PyTorch's fused SDPA.

    python bench/decode_attention.py [--dtypes bfloat16,float32] [--iters 30] [--json]

One query row per sequence over a paged cache, SmolLM2-135M's heads (9 query, 3 KV,
head_dim 64), the shapes a decode step sees: batch 1 and 16, context 256 and 1024
(batch 16 with mixed lengths, masked). Both sides gather the blocks the same way
(``index_select``); the comparison is `tandem.kernels.torch_ref.decode_attention`
against ``F.scaled_dot_product_attention(..., attn_mask, enable_gqa=True)`` on the
same gathered K/V, which is what the backend called before. Median of ``--iters``,
in the same run, with the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tandem.kernels import torch_ref  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _sdpa(q, k_cache, v_cache, tables, lens, max_len, scale):
    batch, width = tables.shape

    def gather(cache):
        blocks = cache.index_select(0, tables.flatten()).view(batch, width * BLOCK, KV_HEADS, -1)
        return blocks[:, :max_len].transpose(1, 2)

    mask = None
    if batch > 1:
        mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[:, :, 0]


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def case(dtype: torch.dtype, batch: int, context: int, iters: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks].view(batch, blocks)
    lens = torch.randint(context // 2, context + 1, (batch,), generator=gen)
    lens[0] = context
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, tables, lens, context, HEAD_DIM**-0.5)
    ours = torch_ref.decode_attention(*args)
    fused = _sdpa(*args)
    row = {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": context,
        "tandem_ms": _median_ms(lambda: torch_ref.decode_attention(*args), iters),
        "sdpa_ms": _median_ms(lambda: _sdpa(*args), iters),
        "max_diff": (ours.float() - fused.float()).abs().max().item(),
    }
    row["speedup"] = row["sdpa_ms"] / row["tandem_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [
        case(getattr(torch, name), batch, context, args.iters)
        for name in args.dtypes.split(",")
        for batch in (1, 16)
        for context in (256, 1024)
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"torch threads {torch.get_num_threads()}")
    print(f"{'dtype':>9} {'batch':>5} {'context':>7} {'tandem ms':>9} {'SDPA ms':>8} "
          f"{'speedup':>7} {'max diff':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['batch']:>5} {r['context']:>7} {r['tandem_ms']:>9.3f} "
            f"{r['sdpa_ms']:>8.3f} {r['speedup']:>7.2f} {r['max_diff']:>9.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
