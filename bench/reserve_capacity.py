"""Sequences per decode worker: reserving max_tokens up front against reserving what is
used (``reserve_output_tokens``), side by side in one run.

    python bench/reserve_capacity.py [--model M] [--requests 48] [--num-blocks 240]
                                     [--max-tokens 512] [--reserve 128] [--json]

One decode engine per setting, the same KV pool (``--num-blocks`` of 16 tokens),
the same chat requests (seeded questions in the model's chat template, greedy, EOS
on), each asking for ``--max-tokens`` but, as clients do, using far fewer. Requests
arrive all at once and take the decode worker's own path for a prompt it prefills
itself (``LLMEngine.prefill_here``: the same reservation a KV transfer makes): one
that does not fit now waits until a step frees blocks, as the router's retry would.
Reported per setting: the most and the mean sequences running per step, the
preemptions (a sequence that outgrew its reservation when the pool was full,
recomputed later), the wall clock and output tokens/s; and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "Explain what a prime number is in one sentence.",
    "Give me a tip for sleeping better.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a grey cat.",
    "What is 12 times 12?",
    "Describe the taste of a lemon.",
    "List two benefits of walking.",
]


def run(args: argparse.Namespace, **settings) -> dict:
    """One decode engine (EngineConfig ``settings`` over the defaults here) serving the
    requests; also used by bench/kv_int8.py."""
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.errors import OutOfBlocksError

    config = dict(
        model=args.model,
        device="cpu",
        max_num_seqs=args.requests,
        enable_prefix_caching=False,  # every request computes its own prompt
    )
    engine = LLMEngine(EngineConfig(**{**config, **settings}))
    rng = random.Random(args.seed)
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": rng.choice(QUESTIONS)}])
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    pending = list(enumerate(prompts))
    running_per_step, output_tokens, done = [], 0, 0
    start = time.perf_counter()
    while done < len(prompts):
        while pending:
            i, prompt = pending[0]
            try:
                engine.prefill_here(prompt, params, f"r{i}")
            except OutOfBlocksError:
                break
            pending.pop(0)
        outs = engine.step()
        running_per_step.append(engine.stats.last_sequences)
        output_tokens += sum(len(o.token_ids) for o in outs)
        done += sum(o.finished for o in outs)
    seconds = time.perf_counter() - start
    engine.kv.pool.check_integrity()
    return {
        "reserve_output_tokens": engine.config.reserve_output_tokens,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "num_blocks": engine.kv.pool.num_blocks,
        "max_running": max(running_per_step),
        "mean_running": round(statistics.mean(running_per_step), 2),
        "preemptions": engine.stats.preemptions,
        "seconds": round(seconds, 2),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=240, help="KV blocks of 16 tokens")
    p.add_argument("--max-tokens", type=int, default=512, help="what every request asks for")
    p.add_argument("--reserve", type=int, default=128, help="reserve_output_tokens to compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for reserve in (None, args.reserve):
        label = "max_tokens" if reserve is None else str(reserve)
        print(f"reserve_output_tokens {label} ...", file=sys.stderr)
        rows.append(run(args, reserve_output_tokens=reserve, num_blocks=args.num_blocks))
    worst, used = rows
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{args.requests} chat requests asking for {args.max_tokens} tokens each, "
        f"{args.num_blocks} KV blocks of 16 tokens"
    )
    head = ("reserved up front", "max running", "mean running", "preemptions", "s", "tok/s")
    print(f"{head[0]:<24}" + "".join(f"{h:>13}" for h in head[1:]))
    for r in rows:
        label = (
            "max_tokens"
            if r["reserve_output_tokens"] is None
            else (f"{r['reserve_output_tokens']} tokens")
        )
        print(
            f"{label:<24}{r['max_running']:>13}{r['mean_running']:>13}"
            f"{r['preemptions']:>13}{r['seconds']:>13}{r['output_tok_s']:>13}"
        )
    running = used["mean_running"] / worst["mean_running"]
    rate = used["output_tok_s"] / worst["output_tok_s"]
    print(f"ratio (what is used / worst case): mean running {running:.2f}, output tok/s {rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
