"""Tensor parallelism on this machine: one engine on N ranks against one rank, side by
side in one run, with the same cores in all.

    python bench/tensor_parallel.py [--model M] [--tp 3] [--prompt-tokens 512]
                                    [--decode-tokens 64] [--batch 1,16] [--json]

Per width: the time to prefill one prompt of ``--prompt-tokens`` (the first token),
then the decode rate at each batch size (``--batch``: that many sequences decoding
``--decode-tokens`` tokens together, after their prompts), greedy, in the default
dtype (``--dtype`` to change it). The cores are shared out as a worker would share
them: one rank gets all of them, N ranks get cores / N threads each (at least 1).
Also reported: how many greedy sequences are identical on both widths (all of them
in float32, as the tests check; in bfloat16 the ranks' partial sums round
differently from one matmul's, and a sequence can turn at a near tie), and each
width's ratio to one rank.

What to expect on a small CPU host: tensor parallelism is for models that do not
fit one device, or for compute beyond one device's; on one socket the ranks
share the same cores and memory bandwidth, and each layer adds two all-reduces
(gloo over loopback TCP) and each step a message to every rank, so N ranks are
slower than one. The figure here is that overhead; a GPU node (NCCL, one rank per
device) is where the width pays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def measure(model: str, tp: int, args: argparse.Namespace) -> dict:
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    threads = max(1, len(os.sched_getaffinity(0)) // tp)  # the CPUs it may run on, as serve
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype=args.dtype,
            tensor_parallel_size=tp,
            num_threads=threads,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(args.prompt_tokens, 1024),
        )
    )
    load_s = time.perf_counter() - started
    try:
        vocab = engine.model_config.vocab_size
        prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(args.prompt_tokens)]
        engine.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        engine.generate([prompt], one)
        prefill_s = time.perf_counter() - started
        rows, tokens = {}, {}
        for batch in args.batch:
            prompts = [[(t + b) % (vocab - 1) + 1 for t in prompt[:32]] for b in range(batch)]
            params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
            for p in prompts:  # prefill first, then time the decode steps alone
                engine.add_request(p, params)
            while any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.waiting):
                engine.step()
            out: dict[str, list[int]] = {}
            started = time.perf_counter()
            while engine.has_unfinished():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.token_ids)
            decode_s = time.perf_counter() - started
            rows[batch] = batch * (args.decode_tokens - 1) / decode_s
            tokens[batch] = sorted(out.values())
    finally:
        engine.close()
    return {
        "tp": tp,
        "threads_per_rank": threads,
        "load_s": load_s,
        "prefill_ms": prefill_s * 1e3,
        "decode_tok_s": rows,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3, help="the width to compare with 1 (default 3)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    one, wide = measure(args.model, 1, args), measure(args.model, args.tp, args)
    pairs = [
        (a, b) for n in args.batch for a, b in zip(one["tokens"][n], wide["tokens"][n], strict=True)
    ]
    same = sum(a == b for a, b in pairs)
    if args.json:
        print(json.dumps({"one": one, "wide": wide, "identical": same, "of": len(pairs)}))
        return
    print(
        f"{args.model} on {os.cpu_count()} cores: {same} of {len(pairs)} greedy sequences "
        f"identical to TP 1's over {args.decode_tokens} tokens"
    )
    print(f"{'':28}{'TP 1':>12}{f'TP {args.tp}':>12}{'ratio':>8}")
    print(f"{'threads per rank':28}{one['threads_per_rank']:>12}{wide['threads_per_rank']:>12}")
    print(f"{'load (s)':28}{one['load_s']:>12.1f}{wide['load_s']:>12.1f}")
    print(
        f"{f'prefill {args.prompt_tokens} tokens (ms)':28}{one['prefill_ms']:>12.0f}"
        f"{wide['prefill_ms']:>12.0f}{one['prefill_ms'] / wide['prefill_ms']:>8.2f}"
    )
    for batch in args.batch:
        a, b = one["decode_tok_s"][batch], wide["decode_tok_s"][batch]
        print(f"{f'decode batch {batch} (tok/s)':28}{a:>12.1f}{b:>12.1f}{b / a:>8.2f}")
    print("ratio: TP N against TP 1 (above 1: the width is faster)")


if __name__ == "__main__":
    main()
