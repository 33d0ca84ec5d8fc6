"""Whole decode steps of one engine with each of its CPU fast paths on and off, the
variants interleaved in the same process, so that each path's share of a step is
measured against the same machine state rather than across runs.

    python bench/decode_steps.py [--batches 1,4,8,16] [--prompt-len 128] [--steps 50]
                                 [--rounds 3] [--dtype auto] [--json]

The default model at its defaults (bfloat16 where native; ``--dtype float32`` runs
it as a CPU without native bfloat16 does). For each batch size:
that many requests of ``--prompt-len`` random token ids, prefilled, then
``--steps`` decode steps timed one by one; the median step counts. Variants:
- ``all``: the engine as it runs;
- ``no-amx``: the projections' AMX tiles set aside (tandem/kernels/cpu/gguf_linear.c):
  steps of up to 8 rows take torch's int4 kernel, larger ones the dense weights;
- ``no-head-codes``: the LM head on its dense weights instead of its 8-bit codes;
- ``no-f32-codes`` (float32): the projections and the LM head on their dense weights
  instead of their codes (tandem/kernels/cpu/codes_f32.c);
- ``no-fused-norm``: RMSNorm and its residual add in torch's ops instead of
  tandem/kernels/cpu/rms_norm.c;
- ``no-step-ops``: RoPE, the KV store and the greedy argmax in torch's ops instead of
  tandem/kernels/cpu/step_ops.c.
A variant that changes nothing on this machine (no AMX, float32) is left out. Each
round runs every variant once per batch size; the table shows the median of the
rounds and ``all``'s speed-up over each variant (> 1: the path pays).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tandem.config import EngineConfig  # noqa: E402
from tandem.engine import model as model_module  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.engine.model import Linear  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.kernels import cpu as cpu_backend  # noqa: E402


def _variants(engine: LLMEngine) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    linears = [m for m in engine.model.modules() if isinstance(m, Linear) and m.int4]
    projections = [m for m in linears if m.int4.packed is not None and m.int4.tiles is not None]
    f32_codes = [m for m in linears if m.int4.f32_codes is not None]
    head = engine.model.lm_head if engine.model.lm_head in linears and not f32_codes else None

    @contextlib.contextmanager
    def without_tiles() -> Iterator[None]:
        saved = [m.int4 for m in projections]
        for m in projections:
            m.int4 = m.int4._replace(tiles=None, tile_scales=None)
        try:
            yield
        finally:
            for m, forms in zip(projections, saved, strict=True):
                m.int4 = forms

    @contextlib.contextmanager
    def without_f32_codes() -> Iterator[None]:
        saved = [m.int4 for m in f32_codes]
        for m in f32_codes:
            m.int4 = None
        try:
            yield
        finally:
            for m, forms in zip(f32_codes, saved, strict=True):
                m.int4 = forms

    @contextlib.contextmanager
    def without_head_codes() -> Iterator[None]:
        forms, head.int4 = head.int4, None
        try:
            yield
        finally:
            head.int4 = forms

    @contextlib.contextmanager
    def without_fused_norm() -> Iterator[None]:
        norm = model_module.cpu_norm
        fused = norm.rms_norm
        norm.rms_norm = lambda *args, **kwargs: None
        try:
            yield
        finally:
            norm.rms_norm = fused

    @contextlib.contextmanager
    def without_step_ops() -> Iterator[None]:
        ops = model_module.cpu_ops
        saved = ops.rope, ops.argmax, cpu_backend._store_rows
        ops.rope = ops.argmax = lambda *args: None
        cpu_backend._store_rows = lambda *args: False
        try:
            yield
        finally:
            ops.rope, ops.argmax, cpu_backend._store_rows = saved

    variants: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "all": contextlib.nullcontext
    }
    if projections:
        variants["no-amx"] = without_tiles
    if f32_codes:
        variants["no-f32-codes"] = without_f32_codes
    if head is not None:
        variants["no-head-codes"] = without_head_codes
    probe = engine.model.norm.weight
    if model_module.cpu_norm.rms_norm(probe[None, :], probe, 1e-5) is not None:
        variants["no-fused-norm"] = without_fused_norm
    if model_module.cpu_ops.argmax(probe[None, :].float()) is not None:
        variants["no-step-ops"] = without_step_ops
    return variants


def _median_step_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
        engine.step()  # prefill (chunked as the engine does), to every request's first token
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: bf16 where native)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    config = EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    engine = LLMEngine(config)
    variants = _variants(engine)
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[int, dict[str, list[float]]] = {b: {v: [] for v in variants} for b in batches}
    for r in range(args.rounds):
        for b in batches:
            for name, context in variants.items():
                with context():
                    times[b][name].append(_median_step_ms(engine, b, args.prompt_len, args.steps))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    result = {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "step_ms": {
            b: {v: round(statistics.median(t), 2) for v, t in by.items()} for b, by in times.items()
        },
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model} in {result['dtype']}: median decode step, ms (all's speed-up over it)")
    print(f"{'batch':>6} " + " ".join(f"{v:>22}" for v in variants))
    for b, by in result["step_ms"].items():
        cells = [f"{ms:.2f} ({ms / by['all']:.2f}x)" for ms in by.values()]
        print(f"{b:>6} " + " ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
