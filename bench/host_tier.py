"""The host-memory KV tier: what a swap costs against recomputing, and whether the tier
helps a decode worker on this machine, side by side in one run.

    python bench/host_tier.py [--model M] [--blocks 32] [--requests 48]
                              [--num-blocks 120] [--host-blocks 240] [--json]

1. Cost per block of 16 tokens (the cost model behind "swap when the tier has room"):
   swapping ``--blocks`` blocks out to the tier and back in (two copies of their
   bytes), against recomputing their tokens (one prefill of ``--blocks`` x 16 tokens
   and its next token, as a preempted sequence's recompute runs). Median of 5.
2. bench/reserve_capacity.py's run (``--requests`` chat requests at once, each asking
   for 512 tokens, reserving only 16 ahead so that sequences outgrow the pool and
   are preempted) with: ``--num-blocks`` and no tier (preemption recomputes); the
   same blocks and a tier of ``--host-blocks`` (preemption swaps); and no tier but
   ``--num-blocks`` + ``--host-blocks`` blocks (the same memory as one cache).
   On a CPU the cache already is host memory: if the third row is as good as the
   second, the tier should stay off here (it is, by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reserve_capacity


def prompt_of(encode, blocks: int) -> list[int]:
    """``blocks`` x 16 tokens of text to recompute: as many as the blocks timed (a text
    of fixed length made each block look cheaper past its end, the time divided by
    blocks it never computed)."""
    sentence = encode("The history of the lighthouse keeper. ")
    return (sentence * (blocks * 16 // len(sentence) + 1))[: blocks * 16]


def cost_per_block(args: argparse.Namespace) -> dict:
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.kv_cache import bytes_per_block
    from tandem.engine.sampling_params import SamplingParams

    probe = LLMEngine(EngineConfig(model=args.model, device="cpu", num_blocks=1))
    per_block = bytes_per_block(probe.model_config, probe.kv.block_size, probe.kv_dtype)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            num_blocks=4 * args.blocks,
            host_kv_cache_bytes=2 * args.blocks * per_block,
            enable_prefix_caching=False,
            max_num_batched_tokens=args.blocks * 16,
        )
    )
    kv, host = engine.kv, engine.kv.host
    blocks = kv.pool.allocate(args.blocks)

    def swap() -> None:
        moved = host.swap_out(kv.tensor, blocks)
        host.swap_in(moved, kv.tensor, blocks)

    tokens = prompt_of(engine.tokenizer.encode, args.blocks)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def timed(fn) -> float:
        fn()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return 1e3 * statistics.median(runs) / args.blocks

    swap_ms = timed(swap)
    # What a recomputed sequence costs: one prefill step and its next token (no prefix
    # cache here), not a scoring pass, whose LM head runs on every row.
    recompute_ms = timed(lambda: engine.generate([tokens], one))
    kv.pool.free(blocks)
    return {
        "block_bytes": per_block,
        "swap_ms_per_block": swap_ms,
        "recompute_ms_per_block": recompute_ms,
        "recompute_over_swap": recompute_ms / swap_ms,
    }


def capacity(args: argparse.Namespace) -> list[dict]:
    from reserve_capacity import run

    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.kv_cache import bytes_per_block

    probe = LLMEngine(EngineConfig(model=args.model, device="cpu", num_blocks=1))
    per_block = bytes_per_block(probe.model_config, probe.kv.block_size, probe.kv_dtype)
    cap_args = argparse.Namespace(model=args.model, requests=args.requests, max_tokens=512,
                                  seed=0)  # fmt: skip
    settings = [
        ("no tier", args.num_blocks, 0),
        ("host tier", args.num_blocks, args.host_blocks),
        ("one bigger cache", args.num_blocks + args.host_blocks, 0),
    ]
    rows = []
    for label, blocks, host in settings:
        print(f"{label} ...", file=sys.stderr)
        row = run(
            cap_args,
            num_blocks=blocks,
            host_kv_cache_bytes=host * per_block,
            reserve_output_tokens=16,
        )
        rows.append({"setting": label, "host_blocks": host, **row})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--blocks", type=int, default=32, help="blocks per timed swap / recompute")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=120)
    p.add_argument("--host-blocks", type=int, default=240)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = {"cost": cost_per_block(args), "capacity": capacity(args)}
    if args.json:
        print(json.dumps(result))
        return 0
    c = result["cost"]
    print(f"cost per block of 16 tokens ({c['block_bytes']:,} bytes):")
    print(f"  swap out and in  {c['swap_ms_per_block']:8.3f} ms")
    print(f"  recompute        {c['recompute_ms_per_block']:8.3f} ms")
    print(f"  recompute / swap {c['recompute_over_swap']:8.1f}")
    print(f"\n{args.requests} chat requests at once, 512 tokens asked, 16 reserved ahead")
    head = ("setting", "blocks", "host", "preempt", "max run", "mean run", "s", "tok/s")
    print(f"{head[0]:<18}" + "".join(f"{h:>10}" for h in head[1:]))
    for r in result["capacity"]:
        print(
            f"{r['setting']:<18}{r['num_blocks']:>10}{r['host_blocks']:>10}{r['preemptions']:>10}"
            f"{r['max_running']:>10}{r['mean_running']:>10}{r['seconds']:>10}"
            f"{r['output_tok_s']:>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
