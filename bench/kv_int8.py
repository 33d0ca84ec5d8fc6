"""int8 KV cache against the model-dtype cache, side by side in one run: quality
(greedy agreement, perplexity) and capacity (sequences per decode worker, KV bytes
per request).

    python bench/kv_int8.py [--model M] [--dtype auto] [--prompts 32] [--tokens 64]
                            [--text FILE] [--ppl-tokens 1024] [--requests 96]
                            [--kv-mib 88] [--skip-capacity] [--json]

Quality: one engine per ``kv_cache_dtype`` (auto, int8), everything else equal.
- Greedy agreement: ``--prompts`` chat requests (seeded questions in the model's
  chat template), ``--tokens`` tokens each with EOS ignored, batched together; the
  fraction of requests whose tokens are all identical to the float cache's, and the
  mean length of the matching prefix.
- Perplexity on a fixed text (default: the running Python's LICENSE.txt, English
  prose and tables; ``--text`` another file): its first ``--ppl-tokens`` tokens
  prefilled in chunks of 256 through the paged cache, so each chunk attends over
  the earlier chunks' stored (for int8: quantized) KV and its own tokens' KV as
  computed, and every token's log-probability scored.
- The int8 cache without K's per-channel balance (tandem/engine/k_balance.py), the
  format before it, as a third engine: the same prompts, text and counts.
- The yardstick for agreement, in the same run: the float cache once more through
  the other attention backend (the torch reference instead of the C kernel, or
  the other way round), two correct computations that differ only in rounding.
  In a float32 model they agree on every token; in bfloat16 a model's near-ties
  make even they part, and int8 can only be read against that floor.

Capacity: bench/reserve_capacity.py's run at one KV budget (``--kv-mib``) for
both caches: ``--requests`` chat requests arriving at once, each asking for 512
tokens, reserving what they use (128 output tokens ahead); the most and the mean
sequences running per step. Plus the KV bytes a transfer moves for a 512-token
prompt (the blocks it fills, values and scales).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reserve_capacity

CHUNK = 256
SETTINGS = ("auto", "int8")
QUALITY = ("auto", "int8", "int8-unbalanced")


def make_engine(args: argparse.Namespace, kv_cache_dtype: str, **settings):
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=False,
            max_num_seqs=max(args.prompts, 1),
            **settings,
        )
    )


def unbalanced(engine):
    """``engine`` with its int8 cache's K factors taken off: K stored as computed."""
    for layer in engine.model.layers:
        layer.self_attn.k_balance = layer.self_attn.q_balance = None
    return engine


def greedy(engine, args: argparse.Namespace) -> list[list[int]]:
    from reserve_capacity import QUESTIONS

    from tandem.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    topics = ["a river", "the moon", "bread", "a library", "winter", "trains", "music", "bees"]
    prompts = []
    for i in range(args.prompts):
        # The fixed questions first, then seeded variations of them.
        if i < len(QUESTIONS):
            q = QUESTIONS[i]
        else:
            q = f"{rng.choice(QUESTIONS)} Then mention {rng.choice(topics)}."
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": q}]))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    return engine.generate(prompts, params)


def perplexity(engine, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``ids[1:]``, prefilled CHUNK tokens at a
    time through the engine's paged cache (``LLMEngine.score``)."""
    logps = engine.score(ids, chunk_tokens=CHUNK)
    return math.exp(-sum(logps) / len(logps))


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(the fraction of requests whose tokens are all identical, the mean length of the
    matching prefix)."""
    prefix = []
    for a, b in zip(ref, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(n)
    whole = sum(n == len(a) for n, a in zip(prefix, ref, strict=True))
    return whole / len(prefix), statistics.mean(prefix)


def quality(args: argparse.Namespace, text_ids: list[int]) -> dict:
    rows = {}
    for setting in QUALITY:
        print(f"quality, kv_cache_dtype {setting} ...", file=sys.stderr)
        if setting == "int8-unbalanced":
            engine = unbalanced(make_engine(args, "int8"))
        else:
            engine = make_engine(args, setting)
        start = time.perf_counter()
        outputs = greedy(engine, args)
        ppl = perplexity(engine, text_ids)
        rows[setting] = {
            "outputs": outputs,
            "perplexity": ppl,
            "seconds": time.perf_counter() - start,
            "cache": str(engine.kv_dtype).removeprefix("torch."),
            "backend": engine.attention_backend,
        }
    from tandem.errors import ConfigError

    ref = rows["auto"]["outputs"]
    identical, matching = agreement(ref, rows["int8"]["outputs"])
    plain_identical, plain_matching = agreement(ref, rows["int8-unbalanced"]["outputs"])
    other = "cpu" if rows["auto"]["backend"] == "torch" else "torch"
    print(f"quality, kv_cache_dtype auto, attention backend {other} ...", file=sys.stderr)
    try:
        floor = greedy(make_engine(args, "auto", attention_backend=other), args)
        floor_identical, floor_matching = agreement(ref, floor)
    except ConfigError as exc:  # the C kernels do not build here: no second backend
        print(f"no yardstick: {exc}", file=sys.stderr)
        other, floor_identical, floor_matching = None, None, None
    return {
        "requests": len(ref),
        "tokens": args.tokens,
        "identical": identical,
        "mean_matching_prefix": matching,
        "unbalanced_identical": plain_identical,
        "unbalanced_mean_matching_prefix": plain_matching,
        # The float cache through the other attention backend, against the first.
        "backends": [rows["auto"]["backend"], other],
        "float_identical": floor_identical,
        "float_mean_matching_prefix": floor_matching,
        "ppl_tokens": len(text_ids),
        "perplexity": {k: round(v["perplexity"], 4) for k, v in rows.items()},
        "ppl_ratio": rows["int8"]["perplexity"] / rows["auto"]["perplexity"],
        "unbalanced_ppl_ratio": rows["int8-unbalanced"]["perplexity"] / rows["auto"]["perplexity"],
        "cache": {k: v["cache"] for k, v in rows.items()},
    }


def capacity(args: argparse.Namespace, probe) -> dict:
    import torch
    from reserve_capacity import run

    from tandem.engine.kv_cache import bytes_per_block

    cap_args = argparse.Namespace(
        model=args.model, requests=args.requests, max_tokens=512, seed=args.seed
    )
    rows = {}
    for setting in SETTINGS:
        print(f"capacity, kv_cache_dtype {setting} ...", file=sys.stderr)
        rows[setting] = run(
            cap_args,
            dtype=args.dtype,
            kv_cache_dtype=setting,
            kv_cache_bytes=args.kv_mib * 2**20,
            reserve_output_tokens=128,
        )
    mc, bs = probe.model_config, probe.kv.block_size
    blocks = -(-512 // bs)
    transfer = {
        "auto": blocks * bytes_per_block(mc, bs, probe.dtype),
        "int8": blocks * bytes_per_block(mc, bs, torch.int8),
    }
    return {"runs": rows, "transfer_bytes_512": transfer}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: bf16 where native)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--text", default=None, help="perplexity text (default: Python's LICENSE.txt)")
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=96, help="capacity: chat requests at once")
    p.add_argument("--kv-mib", type=int, default=88, help="capacity: the KV budget, MiB")
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    text_path = Path(args.text or Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    try:
        text = text_path.read_text()
    except OSError as exc:
        raise SystemExit(f"cannot read the perplexity text: {exc} (pass --text FILE)") from exc
    probe = make_engine(args, "auto", num_blocks=1)
    text_ids = probe.tokenizer.encode(text)[: args.ppl_tokens]
    result = {"quality": quality(args, text_ids)}
    if not args.skip_capacity:
        result["capacity"] = capacity(args, probe)
    del probe
    if args.json:
        print(json.dumps(result))
        return 0

    q = result["quality"]
    print(
        f"model {args.model}, model dtype {args.dtype}; caches: "
        f"{q['cache']['auto']} (auto) and {q['cache']['int8']} (int8)"
    )
    print(f"\nquality: {q['requests']} chat prompts x {q['tokens']} greedy tokens; perplexity")
    print(f"on {q['ppl_tokens']} tokens of {text_path.name} (chunks of {CHUNK})")
    print("(int8 unbalanced: the int8 cache without K's per-channel factors)")
    print(f"{'':<34}{'auto':>12}{'int8':>12}{'int8/auto':>12}{'unbalanced':>12}{'/auto':>8}")
    ppl = q["perplexity"]
    print(
        f"{'perplexity':<34}{ppl['auto']:>12.4f}{ppl['int8']:>12.4f}{q['ppl_ratio']:>12.4f}"
        f"{ppl['int8-unbalanced']:>12.4f}{q['unbalanced_ppl_ratio']:>8.4f}"
    )
    print(
        f"{'requests identical over all tokens':<34}{'':>12}{q['identical']:>12.3f}{'':>12}"
        f"{q['unbalanced_identical']:>12.3f}"
    )
    print(
        f"{'mean matching prefix (tokens)':<34}{'':>12}{q['mean_matching_prefix']:>12.1f}"
        f"{'':>12}{q['unbalanced_mean_matching_prefix']:>12.1f}"
    )
    mine, other = q["backends"]
    if other is not None:
        print(f"the float cache through the {other} attention backend against the {mine} one:")
        print(f"{'requests identical over all tokens':<34}{q['float_identical']:>12.3f}")
        print(f"{'mean matching prefix (tokens)':<34}{q['float_mean_matching_prefix']:>12.1f}")
    if "capacity" in result:
        c = result["capacity"]
        a, b = c["runs"]["auto"], c["runs"]["int8"]
        print(f"\ncapacity: {args.requests} chat requests at once, {args.kv_mib} MiB of KV")
        print(f"{'':<34}{'auto':>12}{'int8':>12}{'int8/auto':>12}")
        for key, label in (
            ("num_blocks", "KV blocks of 16 tokens"),
            ("max_running", "most sequences running"),
            ("mean_running", "mean sequences running"),
            ("output_tok_s", "output tok/s"),
        ):
            print(f"{label:<34}{a[key]:>12}{b[key]:>12}{b[key] / a[key]:>12.2f}")
        t = c["transfer_bytes_512"]
        print(
            f"{'KV bytes, a 512-token prompt':<34}{t['auto']:>12,}{t['int8']:>12,}"
            f"{t['int8'] / t['auto']:>12.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
