"""The engine's CPU projections (weights prepacked for oneDNN, ``Linear.pack``) against
``F.linear(x, W)`` (what Hugging Face and ``nn.Linear`` run), by the rows ``x`` has;
and the GGUF's 4-bit codes (``tandem/engine/gguf_int4.py``).

    python bench/linear_forms.py [--rows 1,2,4,8,16,32,64,128,256,512]
                                 [--dtypes float32,bfloat16] [--iters 5] [--json]

The weights are SmolLM2-135M's four projections per layer (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) for all 30 layers, random Q4_1 codes (as the default
model's GGUF stores them) dequantised, and distinct, so each pass
reads the whole model's projections from memory as a real forward does rather than
from a warm cache. A decode step feeds the projections one row per sequence; a
prefill, one per prompt token. Median of --iters passes, the two forms interleaved,
in the same run; the ratio is F.linear's time over the engine's (> 1: the engine's
form is faster). The values are checked equal up to the dtype's rounding first. In
bfloat16 the same projections also run from their codes in the same interleaved
passes: ``int4``, torch's kernel (``_weight_int4pack_mm_for_cpu``), and, on a CPU
with AMX and for up to 64 rows, ``amx``, Tandem's (``tandem/kernels/cpu/gguf_linear.c``);
``packed/int4`` and ``packed/amx`` > 1: the codes are faster. In float32, up to 16
rows, ``f32codes``: ``tandem/kernels/cpu/codes_f32.c``, the codes expanded to float32
in registers. These columns set which kernel a step of n rows runs
(``gguf_int4.TORCH_MAX_ROWS``, ``AMX_MIN_ROWS``, ``F32_MAX_ROWS``).
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


def _codes(out: int, inp: int, gen: torch.Generator):
    from tandem.engine.gguf_int4 import GROUP, Q4_1

    scales = (torch.rand(out, inp // GROUP, generator=gen) * 0.01).half().float()
    mins = (-torch.rand(out, inp // GROUP, generator=gen) * 0.08).half().float()
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    return Q4_1(codes, scales, mins)


def _measure(dtype: torch.dtype, rows: list[int], iters: int) -> list[dict] | None:
    from tandem.engine import gguf_int4
    from tandem.engine.model import Linear

    with_int4 = dtype == torch.bfloat16 and gguf_int4.available()
    with_amx = with_int4 and gguf_int4.amx_available()
    with_f32 = dtype == torch.float32 and gguf_int4.f32_available()
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for out, inp in SHAPES:
            codes = _codes(out, inp, gen)
            dense = codes.dequantize().to(dtype)
            packed = Linear(inp, out, bias=False, dtype=dtype)
            with torch.no_grad():
                packed.weight.copy_(dense)
            if not packed.pack():
                return None
            four_bit = gguf_int4.pack(codes, dtype, with_amx) if with_int4 or with_f32 else None
            layer.append({"linear": dense, "engine": packed, "codes": four_bit})
        layers.append(layer)
    results = []
    for m in rows:
        forms = ["linear", "engine"]
        forms += ["int4"] if with_int4 else []
        forms += ["amx"] if with_amx and m <= gguf_int4.AMX_MAX_ROWS else []
        forms += ["f32codes"] if with_f32 and m <= gguf_int4.F32_KERNEL_MAX_ROWS else []
        xs = {i: torch.randn(m, i, generator=gen).to(dtype) for _, i in SHAPES}
        with torch.inference_mode():

            def run(p: dict, form: str, xs=xs) -> torch.Tensor:
                x = xs[p["linear"].shape[1]]
                if form == "linear":
                    return F.linear(x, p["linear"])
                if form == "int4":
                    c = p["codes"]
                    return torch._weight_int4pack_mm_for_cpu(
                        x, c.packed, gguf_int4.GROUP, c.scales_and_zeros
                    )
                if form == "amx":
                    return gguf_int4.amx_linear(x, p["codes"], None)
                if form == "f32codes":
                    return gguf_int4.f32_linear(x, p["codes"], None)
                return p["engine"](x)

            tol = TOLERANCE[dtype]
            for p in layers[0]:
                for form in forms[1:]:
                    torch.testing.assert_close(run(p, form), run(p, "linear"), rtol=tol, atol=tol)

            def one_pass(form: str) -> float:
                start = time.perf_counter()
                for layer in layers:
                    for p in layer:
                        run(p, form)
                return time.perf_counter() - start

            times: dict[str, list[float]] = {form: [] for form in forms}
            for form in forms:
                one_pass(form)  # warm-up
            for _ in range(iters):
                for form in forms:
                    times[form].append(one_pass(form))
        ms = {form: statistics.median(times[form]) * 1e3 for form in forms}
        row = dict(rows=m, linear_ms=round(ms["linear"], 2), engine_ms=round(ms["engine"], 2))
        row["ratio"] = round(ms["linear"] / ms["engine"], 3)
        for form in ("int4", "amx", "f32codes"):
            if form in ms:
                row[f"{form}_ms"] = round(ms[form], 2)
                row[f"engine_over_{form}"] = round(ms["engine"] / ms[form], 3)
        results.append(row)
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
        codes = [f for f in ("int4", "amx", "f32codes") if any(f"{f}_ms" in r for r in results)]
        print(f"{name}:")
        head = f"{'rows':>6} {'F.linear ms':>12} {'packed ms':>10} {'ratio':>7}"
        print(head + "".join(f" {f + ' ms':>8} {'packed/' + f:>12}" for f in codes))
        for r in results:
            line = (
                f"{r['rows']:>6} {r['linear_ms']:>12.1f} {r['engine_ms']:>10.1f} {r['ratio']:>7.2f}"
            )
            for f in codes:
                if f"{f}_ms" in r:
                    line += f" {r[f + '_ms']:>8.1f} {r['engine_over_' + f]:>12.2f}"
                else:
                    line += f" {'':>8} {'':>12}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
