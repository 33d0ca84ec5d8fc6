"""Engine throughput: Tandem vs Hugging Face ``generate``, side by side in one run.

Same weights (the dequantised default model unless ``--model`` says otherwise),
same torch thread count, same prompts. Tandem runs at its defaults (``--dtype
auto``: bfloat16 on CPUs that compute in it natively, float32 elsewhere); HF runs
in each of ``--hf-dtypes`` and its fastest counts, row by row, so the ratio is
against HF at its best on this CPU. HF is used as its docs show:
``model.generate(input_ids, attention_mask=..., do_sample=False)`` with a KV
cache; EOS is ignored on both sides so both produce the same counts.

Scenarios:
1. batch-1 greedy decode tokens/s (time after the first token, so prefill is excluded);
2. N equal requests (prompt P, output O) as one batch: output tokens/s, wall clock;
3. N requests with mixed prompt (32-512) and output (16-256) lengths: Tandem's
   continuous batching vs ``generate`` on one left-padded static batch, which
   runs until the longest output; only the requested tokens count as useful.

Each side runs each scenario ``--repeat`` times (after a shared warm-up) and its
best run counts, so a one-off stall on this shared machine does not decide a ratio.

Where ``llama-cpp-python`` is installed (it is not a dependency) and the model is a
GGUF (the default model is), llama.cpp's batch-1 decode rate on the same prompt is
printed under the table as a reference, not a target: it runs the GGUF's quantized
weights as stored (the default model's are Q4_1), the others dequantised ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=16, help="requests in scenarios 2 and 3")
    p.add_argument("--batch1-tokens", type=int, default=128, help="tokens decoded at batch 1")
    p.add_argument("--prompt-len", type=int, default=128, help="scenario 2 prompt length")
    p.add_argument("--output-len", type=int, default=128, help="scenario 2 output length")
    p.add_argument("--mixed-prompt", default="32,512", help="scenario 3 prompt length range")
    p.add_argument("--mixed-output", default="16,256", help="scenario 3 output length range")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and lengths")
    p.add_argument("--repeat", type=int, default=2, help="runs per side and scenario; best counts")
    p.add_argument("--dtype", default="auto", help="Tandem's dtype (default: its own choice)")
    p.add_argument(
        "--hf-dtypes", default="float32,bfloat16", help="HF dtypes to time; the fastest counts"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _prompts(vocab: int, lengths: list[int], rng: random.Random) -> list[list[int]]:
    # Plain token ids well away from the special tokens at the start of the vocabulary.
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


class _HF:
    def __init__(self, model_dir, dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def generate(self, prompts: list[list[int]], max_new: int) -> float:
        """Left-padded batch, greedy, EOS ignored. Returns seconds."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + max_new
        return elapsed

    def decode_rate(self, prompt: list[int], n: int) -> float:
        """Batch-1 decode tokens/s, excluding prefill (the time of a 1-token run)."""
        t_first = self.generate([prompt], 1)
        t_all = self.generate([prompt], n)
        return (n - 1) / (t_all - t_first)


def _tandem_decode_rate(engine, prompt: list[int], n: int) -> float:
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    first = None  # time of the first token: what follows is pure decode
    count = 0
    for out in engine.stream(prompt, params):
        count += len(out.token_ids)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert count == n and first is not None
    return (n - 1) / (end - first)


def _tandem_batch(engine, prompts: list[list[int]], outs: list[int]) -> float:
    from tandem.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r) for r in results] == outs
    return elapsed


def _llama_cpp_decode_rate(gguf: Path, prompt: list[int], n: int, threads: int) -> float:
    """llama.cpp's batch-1 decode tokens/s after the first token, greedy, EOS ignored."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_ctx=len(prompt) + n + 8,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    first, count = None, 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == n:
            break
    end = time.perf_counter()
    assert first is not None
    return (n - 1) / (end - first)


def _codes_in_use(engine) -> tuple[int, bool]:
    """(the most rows a step may have and read the GGUF's codes, 0 if none does;
    whether the AMX kernel reads them)."""
    from tandem.engine import gguf_int4
    from tandem.engine.model import Linear

    codes = [m.int4 for m in engine.model.modules() if isinstance(m, Linear) and m.int4]
    if not codes:
        return 0, False
    rows, amx = engine.config.int4_max_rows, any(c.tiles is not None for c in codes)
    if any(c.f32_codes is not None for c in codes):
        rows = min(rows, gguf_int4.F32_MAX_ROWS)
    elif not amx:  # torch's int4 kernel alone: it serves the smallest steps only
        rows = min(rows, gguf_int4.TORCH_MAX_ROWS)
    return rows, amx


def _repeat(args: argparse.Namespace, fn) -> list[float]:
    return [fn() for _ in range(args.repeat)]


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    log = sys.stderr
    print(f"loading {args.model} (threads={torch.get_num_threads()}) ...", file=log)
    # Repeats reuse the same prompts; prefix caching would turn them into cache hits,
    # a gain HF generate cannot have, so it is off here.
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    )
    hf_dtypes = [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    hfs = {d: _HF(engine.model_dir, getattr(torch, d)) for d in hf_dtypes}
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)

    # Warm every side up so one-time allocations and lazy inits are not timed.
    warm = _prompts(vocab, [16], rng)
    _tandem_batch(engine, warm, [4])
    for hf in hfs.values():
        hf.generate(warm, 4)

    def fastest_hf(rate) -> tuple[float, str]:
        """HF's best rate over its dtypes, and that dtype."""
        return max((max(_repeat(args, lambda hf=hf: rate(hf))), d) for d, hf in hfs.items())

    rows = []
    print("1/3 batch-1 decode ...", file=log)
    (p1,) = _prompts(vocab, [32], rng)
    t_rate = max(_repeat(args, lambda: _tandem_decode_rate(engine, p1, args.batch1_tokens)))
    h_rate, h_dtype = fastest_hf(lambda hf: hf.decode_rate(p1, args.batch1_tokens))
    rows.append(("batch1", "batch-1 decode tok/s", t_rate, h_rate, h_dtype))
    from tandem.engine.loader import gguf_file

    gguf = gguf_file(args.model)
    llama_rate = None
    if gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        threads = torch.get_num_threads()
        rates = _repeat(args, lambda: _llama_cpp_decode_rate(gguf, p1, args.batch1_tokens, threads))
        llama_rate = max(rates)

    print(f"2/3 {args.batch} x ({args.prompt_len} in, {args.output_len} out) ...", file=log)
    prompts = _prompts(vocab, [args.prompt_len] * args.batch, rng)
    outs = [args.output_len] * args.batch
    useful = sum(outs)
    t_s = min(_repeat(args, lambda: _tandem_batch(engine, prompts, outs)))
    h_rate, h_dtype = fastest_hf(lambda hf: useful / hf.generate(prompts, args.output_len))
    label = f"{args.batch} equal requests, output tok/s"
    rows.append(("batch16", label, useful / t_s, h_rate, h_dtype))

    print(f"3/3 {args.batch} mixed-length requests ...", file=log)
    plo, phi = _range(args.mixed_prompt)
    olo, ohi = _range(args.mixed_output)
    prompts = _prompts(vocab, [rng.randint(plo, phi) for _ in range(args.batch)], rng)
    outs = [rng.randint(olo, ohi) for _ in range(args.batch)]
    useful = sum(outs)
    t_s = min(_repeat(args, lambda: _tandem_batch(engine, prompts, outs)))
    h_rate, h_dtype = fastest_hf(lambda hf: useful / hf.generate(prompts, max(outs)))
    label = f"{args.batch} mixed requests, useful output tok/s"
    rows.append(("mixed", label, useful / t_s, h_rate, h_dtype))
    engine.kv.pool.check_integrity()

    code_rows, amx = _codes_in_use(engine)
    result = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        # Steps of at most this many rows ran from the GGUF's codes (0: none did), on
        # the AMX kernel where it runs (gguf_int4.AMX_MIN_ROWS and up).
        "int4_max_rows": code_rows,
        "amx_kernel": amx,
    }
    for key, _, t, h, h_dtype in rows:
        result[f"{key}_tandem"] = round(t, 2)
        result[f"{key}_hf"] = round(h, 2)
        result[f"{key}_hf_dtype"] = h_dtype
        result[f"{key}_ratio"] = round(t / h, 3)
    if llama_rate is not None:
        result["batch1_llama_cpp"] = round(llama_rate, 2)
    if args.json:
        print(json.dumps(result))
    else:
        int4 = result["int4_max_rows"]
        codes = f" (steps of <= {int4} rows from the GGUF's codes" if int4 else ""
        codes += (", on the AMX kernel)" if result["amx_kernel"] else ")") if int4 else ""
        print(f"tandem in {result['dtype']}{codes}; hf generate at its fastest of {', '.join(hfs)}")
        head = ("scenario", "tandem", "hf generate", "hf dtype", "ratio")
        print(f"{head[0]:<42} {head[1]:>10} {head[2]:>12} {head[3]:>9} {head[4]:>7}")
        for _, label, t, h, h_dtype in rows:
            print(f"{label:<42} {t:>10.1f} {h:>12.1f} {h_dtype:>9} {t / h:>7.2f}")
        if llama_rate is not None:
            print(
                f"reference, not a target: llama.cpp batch-1 decode {llama_rate:.1f} tok/s "
                f"on the GGUF's own quantized weights ({gguf.name}); Tandem / llama.cpp "
                f"{result['batch1_tandem'] / llama_rate:.2f}"
            )
    return 0
