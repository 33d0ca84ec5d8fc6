"""Attention sinks + a sliding KV window against full attention, side by side in one run:
perplexity on a long text, memory held, and a long answer's text.

    python bench/kv_window.py [--model M] [--text FILE] [--tokens 3072] [--chunk 16]
                              [--windows 256,1024] [--answer-tokens 400] [--json]

One engine per setting (full attention; for each ``--windows`` W: sinks 4 + window W,
and window W without sinks, as StreamingLLM compares them), everything else equal.
- Perplexity on the first ``--tokens`` tokens of a fixed text (default: the running
  Python's LICENSE.txt; ``--text`` another file), scored through the paged cache in
  chunks of ``--chunk`` tokens (``LLMEngine.score``): each chunk attends over what the
  window kept before it plus the chunk itself, and the window slides after each chunk,
  so a smaller chunk is closer to token-by-token decoding. Also the most KV blocks
  the sequence held.
- A long greedy answer (``--answer-tokens``, EOS ignored) to a chat prompt with the
  smallest window: its last 300 characters for each setting, to read for fluency.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."


def make_engine(args: argparse.Namespace, window: int | None, sinks: int):
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            enable_prefix_caching=False,
            kv_window_tokens=window,
            kv_sink_tokens=sinks,
        )
    )


def score(engine, ids: list[int], chunk: int) -> tuple[float, int]:
    """(perplexity, the most blocks held) of ``ids`` scored in chunks."""
    pool, most = engine.kv.pool, 0
    allocate = pool.allocate

    def watched(n: int):
        nonlocal most
        blocks = allocate(n)
        most = max(most, pool.num_used)
        return blocks

    pool.allocate = watched
    try:
        logps = engine.score(ids, chunk_tokens=chunk)
    finally:
        pool.allocate = allocate
    return math.exp(-sum(logps) / len(logps)), most


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text", default=None, help="default: Python's LICENSE.txt")
    p.add_argument("--tokens", type=int, default=3072)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--windows", default="256,1024")
    p.add_argument("--answer-tokens", type=int, default=400)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    text_path = Path(args.text or Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    try:
        text = text_path.read_text()
    except OSError as exc:
        raise SystemExit(f"cannot read the text: {exc} (pass --text FILE)") from exc

    from tandem.engine.sampling_params import SamplingParams

    settings = [("full attention", None, 0)]
    for w in windows:
        settings += [(f"sinks 4 + window {w}", w, 4), (f"window {w}, no sinks", w, 0)]
    rows = []
    ids: list[int] = []
    for label, window, sinks in settings:
        print(f"{label} ...", file=sys.stderr)
        engine = make_engine(args, window, sinks)
        if not ids:
            ids = engine.tokenizer.encode(text)[: args.tokens]
        ppl, most = score(engine, ids, args.chunk)
        row = {"setting": label, "window": window, "sinks": sinks, "perplexity": ppl,
               "most_blocks": most}  # fmt: skip
        if window in (None, min(windows)):
            prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
            params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
            out = engine.generate([prompt], params)[0]
            row["answer_tail"] = engine.tokenizer.decode(out)[-300:]
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["perplexity"]
    print(f"perplexity on {len(ids)} tokens of {text_path.name}, chunks of {args.chunk}")
    print(f"{'setting':<28}{'perplexity':>12}{'vs full':>10}{'most blocks':>13}")
    for r in rows:
        print(
            f"{r['setting']:<28}{r['perplexity']:>12.3f}{r['perplexity'] / base:>10.3f}"
            f"{r['most_blocks']:>13}"
        )
    for r in rows:
        if "answer_tail" in r:
            n = args.answer_tokens
            print(f"\n{r['setting']}, the last 300 characters of a {n}-token answer:")
            print(r["answer_tail"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
