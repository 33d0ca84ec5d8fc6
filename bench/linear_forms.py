"""The engine's CPU projections (weights prepacked for oneDNN, ``Linear.pack``) against
``F.linear(x, W)`` (what Hugging Face and ``nn.Linear`` run), by the rows ``x`` has.

    python bench/linear_forms.py [--rows 1,2,4,8,16,32,64,128,256,512]
                                 [--dtypes float32,bfloat16] [--iters 5] [--json]

The weights are SmolLM2-135M's four projections per layer (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) for all 30 layers, random and distinct, so each pass
reads the whole model's projections from memory as a real forward does rather than
from a warm cache. A decode step feeds the projections one row per sequence; a
prefill, one per prompt token. Median of --iters passes, the two forms interleaved,
in the same run; the ratio is F.linear's time over the engine's (> 1: the engine's
form is faster). The values are checked equal up to the dtype's rounding first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per projection
LAYERS = 30
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _measure(dtype: torch.dtype, rows: list[int], iters: int) -> list[dict] | None:
    from tandem.engine.model import Linear

    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for out, inp in SHAPES:
            dense = torch.randn(out, inp, generator=gen).to(dtype)
            packed = Linear(inp, out, bias=False, dtype=dtype)
            with torch.no_grad():
                packed.weight.copy_(dense)
            if not packed.pack():
                return None
            layer.append((dense, packed))
        layers.append(layer)
    results = []
    for m in rows:
        xs = {i: torch.randn(m, i, generator=gen).to(dtype) for _, i in SHAPES}
        with torch.inference_mode():
            for dense, packed in layers[0]:
                x = xs[dense.shape[1]]
                tol = TOLERANCE[dtype]
                torch.testing.assert_close(packed(x), F.linear(x, dense), rtol=tol, atol=tol)

            def one_pass(engine: bool, xs=xs) -> float:
                start = time.perf_counter()
                for layer in layers:
                    for dense, packed in layer:
                        x = xs[dense.shape[1]]
                        packed(x) if engine else F.linear(x, dense)
                return time.perf_counter() - start

            times: dict[bool, list[float]] = {False: [], True: []}
            one_pass(False), one_pass(True)  # warm-up
            for _ in range(iters):
                for engine in (False, True):
                    times[engine].append(one_pass(engine))
        lin, eng = (statistics.median(times[k]) * 1e3 for k in (False, True))
        results.append(
            dict(
                rows=m, linear_ms=round(lin, 2), engine_ms=round(eng, 2), ratio=round(lin / eng, 3)
            )
        )
        print(f"{str(dtype).removeprefix('torch.')}: {m} rows done", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    by_dtype: dict[str, list[dict] | None] = {}
    for name in (d.strip() for d in args.dtypes.split(",") if d.strip()):
        by_dtype[name] = _measure(getattr(torch, name), rows, args.iters)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "dtypes": by_dtype}))
        return 0
    print(f"threads={torch.get_num_threads()}, 30 layers x 4 projections, median of {args.iters}")
    for name, results in by_dtype.items():
        if results is None:
            print(f"{name}: this CPU's oneDNN cannot prepack it; the engine uses F.linear")
            continue
        print(f"{name}:")
        print(f"{'rows':>6} {'F.linear ms':>12} {'packed ms':>10} {'ratio':>7}")
        for r in results:
            print(
                f"{r['rows']:>6} {r['linear_ms']:>12.1f} {r['engine_ms']:>10.1f} {r['ratio']:>7.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
