"""The engine's float32 CPU matmul, ``(W @ x.T).T``, against ``F.linear(x, W)`` (what
Hugging Face and ``nn.Linear`` run), by the number of rows ``x`` has.

    python bench/linear_forms.py [--rows 1,2,4,8,16,32,64,128,256,512] [--iters 5] [--json]

The weights are SmolLM2-135M's four projections per layer (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) for all 30 layers, random and distinct, so each pass
reads 425 MB from memory as a real forward does rather than from a warm cache.
A decode step feeds the projections one row per sequence; a prefill, one per
prompt token. Both forms give the same values up to float32 rounding (checked).
Median of --iters passes, the two forms interleaved, in the same run; the ratio
is F.linear's time over the engine's (> 1: the engine's form is faster).
``tandem/engine/model.py`` uses the engine's form up to TRANSPOSED_MAX_ROWS rows.
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


def _engine_form(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t().contiguous()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tandem.engine.model import TRANSPOSED_MAX_ROWS

    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen) for o, i in SHAPES] for _ in range(LAYERS)]
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(m, i, generator=gen) for _, i in SHAPES}
        for w in weights[0]:
            x = xs[w.shape[1]]
            torch.testing.assert_close(_engine_form(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)

        def one_pass(form, xs=xs) -> float:
            start = time.perf_counter()
            for layer in weights:
                for w in layer:
                    form(xs[w.shape[1]], w)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"linear": [], "engine": []}
        one_pass(F.linear), one_pass(_engine_form)  # warm-up
        for _ in range(args.iters):
            times["linear"].append(one_pass(F.linear))
            times["engine"].append(one_pass(_engine_form))
        lin, eng = (statistics.median(times[k]) * 1e3 for k in ("linear", "engine"))
        rows_out.append(
            dict(
                rows=m,
                linear_ms=round(lin, 2),
                engine_ms=round(eng, 2),
                ratio=round(lin / eng, 3),
                engine_uses=m <= TRANSPOSED_MAX_ROWS,
            )
        )
        print(f"{m} rows done", file=sys.stderr)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows_out}))
        return 0
    print(f"threads={torch.get_num_threads()}, 30 layers x 4 projections, median of {args.iters}")
    print(f"{'rows':>6} {'F.linear ms':>12} {'(W@x.T).T ms':>13} {'ratio':>7}  engine uses")
    for r in rows_out:
        uses = "(W@x.T).T" if r["engine_uses"] else "F.linear"
        print(
            f"{r['rows']:>6} {r['linear_ms']:>12.1f} {r['engine_ms']:>13.1f} "
            f"{r['ratio']:>7.2f}  {uses}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
