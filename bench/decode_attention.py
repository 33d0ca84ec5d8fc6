"""Decode attention on CPU: the cpu backend's C kernel, the torch backend's batched
matmuls, and PyTorch's fused SDPA, side by side.

    python bench/decode_attention.py [--dtypes bfloat16,float32] [--layers 30] [--iters 30] [--json]

One query row per sequence over a paged cache, SmolLM2-135M's heads (9 query, 3 KV,
head_dim 64), the shapes a decode step sees: batch 1 and 16, context 256 and 1024
(batch 16 with mixed lengths, masked). As in a decode step, each of ``--layers``
layers has its own cache and one call each is timed in turn, so the K and V come
from memory rather than from a cache that one layer's call left warm (``--layers 1``
times that warm case); times are per layer. The cpu backend (`tandem.kernels.cpu`) reads
the blocks in place; the torch backend (`tandem.kernels.torch_ref`) and SDPA gather
them the same way (``index_select``) first; SDPA is
``F.scaled_dot_product_attention(..., attn_mask, enable_gqa=True)``. Median of
``--iters``, in the same run; the ratios are the others' time over the cpu kernel's,
and the max diffs are against a float64 computation of the same attention. The int8
columns: the cpu kernel over an int8 cache (``kv_cache_dtype: int8``) holding the
same K and V, query rotation included, and the cpu kernel's time over the model
dtype's cache divided by that; its error is against the unquantized K and V.
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

from tandem.kernels import cpu, torch_ref  # noqa: E402

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


def case(dtype: torch.dtype, batch: int, context: int, layers: int, iters: int) -> dict:
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
    exact = _sdpa(q.double(), k_cache.double(), v_cache.double(), *args[3:])
    caches = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(layers - 1)]

    def per_layer_ms(fn, caches=caches) -> float:
        def step():
            for k, v in caches:
                fn(q, k, v, *args[3:])

        return _median_ms(step, iters) / len(caches)

    row = {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": context,
        "layers": layers,
        "cpu_ms": per_layer_ms(cpu.decode_attention),
        "torch_ms": per_layer_ms(torch_ref.decode_attention),
        "sdpa_ms": per_layer_ms(_sdpa),
    }
    for name, fn in (("cpu", cpu.decode_attention), ("torch", torch_ref.decode_attention)):
        row[f"{name}_max_diff"] = (fn(*args).double() - exact).abs().max().item()
    k8, v8 = (torch_ref.quantize_int8(torch_ref.rotate(c.float())) for c in (k_cache, v_cache))
    args8 = (q, k8, v8, *args[3:])
    caches8 = [(k8, v8)] + [(k8.clone(), v8.clone()) for _ in range(layers - 1)]
    row["int8_ms"] = per_layer_ms(cpu.decode_attention, caches8)
    row["int8_max_diff"] = (cpu.decode_attention(*args8).double() - exact).abs().max().item()
    row["cpu_over_int8"] = row["cpu_ms"] / row["int8_ms"]
    row["torch_over_cpu"] = row["torch_ms"] / row["cpu_ms"]
    row["sdpa_over_cpu"] = row["sdpa_ms"] / row["cpu_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument(
        "--layers", type=int, default=30, help="caches timed in turn, as a step's layers"
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not cpu.load():
        print("the cpu backend's kernels did not build here (see the log)", file=sys.stderr)
        return 1
    rows = [
        case(getattr(torch, name), batch, context, args.layers, args.iters)
        for name in args.dtypes.split(",")
        for batch in (1, 16)
        for context in (256, 1024)
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    threads = torch.get_num_threads()
    print(f"torch threads {threads}; ms per layer, {args.layers} layers' caches in turn")
    head = ("dtype", "batch", "context", "cpu ms", "torch ms", "SDPA ms", "torch/cpu", "SDPA/cpu")
    tail = ("cpu err", "torch err", "int8 ms", "cpu/int8", "int8 err")
    print(" ".join(f"{h:>9}" for h in (*head, *tail)))
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['batch']:>9} {r['context']:>9} {r['cpu_ms']:>9.3f} "
            f"{r['torch_ms']:>9.3f} {r['sdpa_ms']:>9.3f} {r['torch_over_cpu']:>9.2f} "
            f"{r['sdpa_over_cpu']:>9.2f} {r['cpu_max_diff']:>9.1e} {r['torch_max_diff']:>9.1e} "
            f"{r['int8_ms']:>9.3f} {r['cpu_over_int8']:>9.2f} {r['int8_max_diff']:>9.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
