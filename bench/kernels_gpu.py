"""The Triton kernels on a GPU: correct on realistic shapes, and how close to the device's ceiling.

python bench/kernels_gpu.py [--quick] [--budget-s 420] [--no-sweep]

In order, each case caught and reported on its own (a failure does not stop the rest):
1. ceilings, measured in this run: device-to-device copy GB/s (1 GiB, read + write)
   and the bf16 matmul rate (8192^3);
2. checks: every kernel against the torch reference (float32, from the same inputs)
   on 7B-style heads (32 query heads, 8 KV heads, head_dim 128) and two other head
   layouts, in bf16 / fp16 / fp32: random lengths (1 and block multiples among them),
   shuffled block tables padded with the null block, forced split counts, prefill
   over a cached prefix;
3. decode attention, batch 1-256 x context 128-32k (bf16): GB/s against the copy
   ceiling, and PyTorch SDPA on the same data gathered into contiguous tensors;
4. prefill attention, 512-16k new tokens, with and without a cached prefix (bf16):
   TFLOP/s against the matmul ceiling, and SDPA;
5. KV store; 6. a small sweep of tile sizes at the two target shapes (not with
   --quick or --no-sweep; run last, so that a short budget cuts it before the
   checks of the later sections); 7. RMSNorm and RoPE as the engine runs them in torch, to
   weigh fusing them against one layer's attention; 8. KV transfer between two
   processes, cache to cache on the device, through the UCX backend as a prefill
   and a decode worker use it (the decode side reads the blocks with UCX gets:
   cuda_ipc on one node), layer by layer: bit-identical blocks, and GB/s against a
   same-run device copy of the same bytes; 9. the checksum of one request's KV
   computed on the device (tandem/kv_transfer/device_checksum.py, one Triton
   launch) against the torch computation of the same value, a flipped bit caught,
   and its time against the host path it replaced (each run copied to the host,
   then xxh3) in the same run; 10. decode attention over an int8 KV cache
   (kv_cache_dtype: int8; checked in section 2 too) against the same kernel over
   the bf16 cache it was quantized from; 11. tensor parallelism over NCCL, one rank
   per GPU (tandem/engine/parallel.py): greedy tokens of tiny-random on 2 ranks
   against one GPU, float32, and the time of each (skipped with fewer than 2 GPUs);
   12. the host KV tier behind a device cache: page-locked, 256 blocks swapped out
   and in bit-identical, GB/s each way.
Timings: CUDA events around each launch, L2 flushed before it, median of many runs
after warm-up. Progress goes to stdout as it runs, then a table; the last line is
JSON (NaN written as null). Exit status 1 if any check or timed case is wrong or
raised. A case that needs a module this machine lacks is skipped, and says which;
after a sticky CUDA error (an illegal address) the cases left are skipped, as the
context is lost; a SIGTERM (a call's time limit) still prints the table and JSON.

Without CUDA the script says "no CUDA device: nothing to time" and runs section 2
alone with tiny shapes under TRITON_INTERPRET=1 (a check of the script itself).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout

HEADS_7B = (32, 8, 128)  # query heads, KV heads, head_dim (Llama-3-8B / Mistral-7B)
BLOCK_SIZE = 16
MAX_TOKENS = 2**21  # KV tokens per timed decode case: 8 GiB of bf16 K+V per layer
TARGET_DECODE = 0.70  # of copy bandwidth, batch 64 x 4k context
TARGET_PREFILL = 0.50  # of the bf16 matmul rate, 8k tokens
# One request's KV for the transfer cases: 7B-style, 2 MiB per block of 16 tokens.
KV_SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128}
# What the transfer cases import beyond torch (the kernels need nothing else).
KV_MODULES = ["ucxx", "xxhash", "grpc"]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # x max|ref|


@dataclass
class Row:
    section: str
    case: str
    ok: bool | None = None  # None: nothing was checked
    ms: float | None = None
    rate: str = ""  # "812 GB/s" or "402 TFLOP/s"
    pct: float | None = None  # of the device ceiling
    sdpa_ms: float | None = None
    note: str = ""
    data: dict = field(default_factory=dict)


class Bench:
    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.device = device
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.rows: list[Row] = []
        self.cuda = device.type == "cuda"
        # After an illegal address or a device-side assert every CUDA call fails: the
        # error, and the cases left are skipped rather than each failing on it.
        self.lost: str | None = None
        if self.cuda:
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def check_device(self) -> None:
        """After a case raised: give its memory back, and find out whether the device
        still works (a sticky error fails even ``empty_cache``)."""
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            assert torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception as exc:  # noqa: BLE001 - the reason the rest is skipped
            self.lost = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"the CUDA context is lost: {self.lost}; the cases left are skipped", flush=True)

    def free(self) -> None:
        """Give the cached device memory back between sections (not on a lost context)."""
        if self.cuda and self.lost is None:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - found and reported by check_device
                self.check_device()

    def run(self, section: str, case: str, fn) -> Row | None:
        """Run one case, catching anything it raises; past the budget, or once the CUDA
        context is lost, skip it. A module this machine lacks skips the case too."""
        if time.monotonic() - self.start > self.budget_s:
            row = Row(section, case, note="skipped: over the time budget")
        elif self.lost is not None:
            row = Row(section, case, note=f"skipped: the CUDA context is lost ({self.lost})")
        else:
            # What was running, should the call hang.
            print(f"[{time.monotonic() - self.start:6.1f}s] {section:8} {case:36} started",
                  flush=True)  # fmt: skip
            t0 = time.monotonic()
            try:
                row = fn()
                row.section, row.case = section, case
            except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
                row = self._failed(section, case, exc)
            row.data["wall_s"] = round(time.monotonic() - t0, 2)
        self.rows.append(row)
        status = {None: "--", True: "ok", False: "FAIL"}[row.ok]
        print(f"[{time.monotonic() - self.start:6.1f}s] {section:8} {case:36} {status:4} "
              f"{_fmt(row.ms)} ms {row.rate} {row.note}", flush=True)  # fmt: skip
        return row

    def _failed(self, section: str, case: str, exc: Exception) -> Row:
        """The row of a case that raised: skipped where it needs a module this machine
        lacks (a bare GPU image has torch and triton), else failed."""
        if isinstance(exc, ModuleNotFoundError) and _optional(exc.name):
            return Row(section, case, note=f"skipped: needs {exc.name}, not installed")
        traceback.print_exc(file=sys.stdout)
        self.check_device()
        return Row(section, case, ok=False, note=f"ERROR {type(exc).__name__}: {exc}")

    def median_ms(self, fn, target_ms: float = 150.0, max_runs: int = 200) -> float:
        """Median of CUDA-event times of ``fn`` after warm-up, L2 flushed before each run."""
        if not self.cuda:  # only the script's own tests time on CPU: one run, wall clock
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        fn()  # compiles
        torch.cuda.synchronize()
        start, end = _event(), _event()
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = start.elapsed_time(end) / 3
        runs = int(min(max_runs, max(10, target_ms / max(estimate, 1e-3))))
        starts = [_event() for _ in range(runs)]
        ends = [_event() for _ in range(runs)]
        for s, e in zip(starts, ends, strict=True):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _optional(module: str | None) -> bool:
    """Whether a missing ``module`` is one a GPU image may lack, not a bug: anything
    but tandem's own modules and the kernels' torch and triton."""
    return bool(module) and module.split(".")[0] not in ("tandem", "torch", "triton")


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _fmt(x: float | None, digits: int = 3) -> str:
    return f"{x:8.{digits}f}" if x is not None else "       -"


# --- inputs ---


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks + 1, block_size, kv_heads, head_dim]; last: null block
    v_cache: torch.Tensor
    tables: torch.Tensor  # [batch, width] int64, padded with the null block
    lens: list[int]


def make_paged(lens, kv_heads, head_dim, dtype, device, block_size=None, seed=0) -> Paged:
    """Random caches holding sequences of ``lens`` in shuffled blocks (of BLOCK_SIZE tokens)."""
    block_size = block_size or BLOCK_SIZE
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    total = sum(counts)
    shape = (total + 1, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    k_cache[-1] = 0
    v_cache[-1] = 0
    ids = torch.randperm(total, generator=gen, device=device)
    tables = torch.full((len(lens), max(counts)), total, dtype=torch.int64, device=device)
    offset = 0
    for i, c in enumerate(counts):
        tables[i, :c] = ids[offset : offset + c]
        offset += c
    return Paged(k_cache, v_cache, tables, list(lens))


def contiguous_kv(p: Paged, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, [kv_heads, length, head_dim] each."""
    n = -(-length // p.k_cache.shape[1])
    ids = p.tables[row, :n]
    k = p.k_cache.index_select(0, ids).flatten(0, 1)[:length].transpose(0, 1)
    v = p.v_cache.index_select(0, ids).flatten(0, 1)[:length].transpose(0, 1)
    return k, v


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _check_row(err: float, dtype: torch.dtype, note: str = "", torch_err: float = 0.0) -> Row:
    """Pass within TOLERANCE, or within twice the error torch itself makes in ``dtype``."""
    tol = max(TOLERANCE[dtype], 2 * torch_err)
    return Row("", "", ok=err <= tol, note=f"err {err:.1e} (tol {tol:.0e}) {note}".strip())


# --- 2. checks against the reference ---


def check_cases(b: Bench, ops, ref, tiny: bool) -> None:
    device = b.device
    layouts = [(8, 2, 32), (4, 4, 16)] if tiny else [HEADS_7B, (32, 32, 128), (14, 2, 64)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    block_size = 4 if tiny else BLOCK_SIZE
    batch, max_len = (5, 40) if tiny else (37, 3000)
    prefills = [(21, 21), (21, 7), (13, 1)] if tiny else [(1000, 1000), (3001, 1000), (5000, 1)]
    gen = torch.Generator().manual_seed(1)
    for heads, kv_heads, head_dim in layouts:
        for dtype in dtypes:
            name = f"{heads}/{kv_heads}x{head_dim} {str(dtype).removeprefix('torch.')}"
            lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
            lens[:3] = [1, block_size, 3 * block_size]  # a single token, whole blocks

            def decode(lens=lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype):
                p = make_paged(lens, kv_heads, head_dim, dtype, device, block_size)
                q = torch.randn(len(lens), heads, head_dim, device=device, dtype=dtype)
                ctx = torch.tensor(lens, device=device)
                args = (p.tables, ctx, max(lens), head_dim**-0.5)
                want = ref.decode_attention(q.float(), p.k_cache.float(), p.v_cache.float(), *args)
                torch_err = rel_error(ref.decode_attention(q, p.k_cache, p.v_cache, *args), want)
                errs = []
                for splits in (None, 1, 3 if tiny else 7):
                    got = ops.decode_attention(q, p.k_cache, p.v_cache, *args, num_splits=splits)
                    errs.append(rel_error(got, want))
                return _check_row(max(errs), dtype, "splits auto/1/n", torch_err)

            b.run("check", f"decode {name}", decode)

            def prefill(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype):
                errs, torch_errs = [], []
                for context_len, query_len in prefills:
                    p = make_paged([context_len], kv_heads, head_dim, dtype, device, block_size)
                    q = torch.randn(query_len, heads, head_dim, device=device, dtype=dtype)
                    args = (p.tables[0], context_len, head_dim**-0.5)
                    got = ops.prefill_attention(q, p.k_cache, p.v_cache, *args)
                    want = ref.prefill_attention(
                        q.float(), p.k_cache.float(), p.v_cache.float(), *args
                    )
                    errs.append(rel_error(got, want))
                    lowp = ref.prefill_attention(q, p.k_cache, p.v_cache, *args)
                    torch_errs.append(rel_error(lowp, want))
                return _check_row(
                    max(errs), dtype, "with and without a cached prefix", max(torch_errs)
                )

            b.run("check", f"prefill {name}", prefill)

            def store(kv_heads=kv_heads, head_dim=head_dim, dtype=dtype):
                p = make_paged([max_len], kv_heads, head_dim, dtype, device, block_size)
                same = all(torch.equal(g, w) for g, w in _store_both(ops, ref, p, head_dim, dtype))
                return Row("", "", ok=same, note="exact" if same else "differs")

            b.run("check", f"store_kv {name}", store)

        int8_checks(b, ops, ref, heads, kv_heads, head_dim, block_size, batch, max_len, prefills)


def _store_both(ops, ref, p: Paged, head_dim: int, dtype: torch.dtype):
    """The same random K and V for half of the first sequence's slots stored by ``ops``
    into ``p``'s caches and by ``ref`` into copies: [(got, wanted)] for K and V."""
    n = p.lens[0]
    slots = torch.randperm(n, device=p.k_cache.device)[: n // 2]
    k = torch.randn(len(slots), p.k_cache.shape[2], head_dim, device=slots.device, dtype=dtype)
    v = torch.randn_like(k)
    want_k, want_v = p.k_cache.clone(), p.v_cache.clone()
    ref.store_kv(k, v, want_k, want_v, slots)
    ops.store_kv(k, v, p.k_cache, p.v_cache, slots)
    return [(p.k_cache, want_k), (p.v_cache, want_v)]


def int8_paged(p: Paged) -> Paged:
    """The same K and V in an int8 cache: rows rotated and quantized as the engine stores them."""
    from tandem.kernels import torch_ref

    def quantize(cache: torch.Tensor) -> torch.Tensor:
        return torch_ref.quantize_int8(torch_ref.rotate(cache.float()))

    return Paged(quantize(p.k_cache), quantize(p.v_cache), p.tables, p.lens)


def int8_checks(b: Bench, ops, ref, heads, kv_heads, head_dim, block_size, batch, max_len,
                prefills) -> None:  # fmt: skip
    """An int8 cache (kv_cache_dtype: int8) with bf16 queries, against the reference
    over the same int8 blocks with float32 queries."""
    device, dtype = b.device, torch.bfloat16
    name = f"{heads}/{kv_heads}x{head_dim} int8 cache"
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[:2] = [1, block_size]

    def decode() -> Row:
        p = int8_paged(make_paged(lens, kv_heads, head_dim, dtype, device, block_size))
        q = torch.randn(len(lens), heads, head_dim, device=device, dtype=dtype)
        args = (p.tables, torch.tensor(lens, device=device), max(lens), head_dim**-0.5)
        want = ref.decode_attention(q.float(), p.k_cache, p.v_cache, *args)
        torch_err = rel_error(ref.decode_attention(q, p.k_cache, p.v_cache, *args), want)
        errs = [rel_error(ops.decode_attention(q, p.k_cache, p.v_cache, *args, num_splits=n), want)
                for n in (None, 1, 3)]  # fmt: skip
        return _check_row(max(errs), dtype, "splits auto/1/3", torch_err)

    def prefill() -> Row:
        errs, torch_errs = [], []
        for context_len, query_len in prefills:
            p = int8_paged(make_paged([context_len], kv_heads, head_dim, dtype, device, block_size))
            q = torch.randn(query_len, heads, head_dim, device=device, dtype=dtype)
            args = (p.tables[0], context_len, head_dim**-0.5)
            # The new tokens' K/V read back from the cache, then taken as computed.
            new = [torch.randn(query_len, kv_heads, head_dim, device=device, dtype=dtype)
                   for _ in range(2)]  # fmt: skip
            for new_kv in (None, tuple(new)):
                wide = None if new_kv is None else tuple(x.float() for x in new_kv)
                want = ref.prefill_attention(q.float(), p.k_cache, p.v_cache, *args, new_kv=wide)
                for out, got in ((errs, ops), (torch_errs, ref)):
                    got_out = got.prefill_attention(q, p.k_cache, p.v_cache, *args, new_kv=new_kv)
                    out.append(rel_error(got_out, want))
        note = "with and without a cached prefix; new K/V stored and as computed"
        return _check_row(max(errs), dtype, note, max(torch_errs))

    def store() -> Row:
        p = int8_paged(make_paged([max_len], kv_heads, head_dim, dtype, device, block_size))
        pairs = _store_both(ops, ref, p, head_dim, dtype)
        if all(torch.equal(got, want) for got, want in pairs):
            return Row("", "", ok=True, note="exact")
        steps = []  # how far off, for the report
        for got, want in pairs:
            scale = want[..., head_dim:].contiguous().view(torch.float16).float()
            diff = (ref.dequantize(got, torch.float32) - ref.dequantize(want, torch.float32)).abs()
            steps.append(float((diff / scale.clamp_min(1e-12)).max()))
        return Row("", "", ok=False, note=f"differs, by up to {max(steps):.2f} quantization steps")

    b.run("check", f"decode {name}", decode)
    b.run("check", f"prefill {name}", prefill)
    b.run("check", f"store_kv {name}", store)


# --- 1. ceilings ---


def copy_gbps(b: Bench) -> float:
    src = torch.empty(2**29, dtype=torch.bfloat16, device=b.device)  # 1 GiB
    dst = torch.empty_like(src)
    ms = b.median_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() * 2 / ms / 1e6
    b.rows.append(Row("ceiling", "copy 1 GiB (read+write)", ms=ms, rate=f"{gbps:.0f} GB/s"))
    return gbps


def matmul_tflops(b: Bench) -> float:
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device=b.device)
    y = torch.randn(n, n, dtype=torch.bfloat16, device=b.device)
    z = torch.empty_like(x)
    ms = b.median_ms(lambda: torch.mm(x, y, out=z))
    tflops = 2 * n**3 / ms / 1e9
    b.rows.append(Row("ceiling", "bf16 matmul 8192^3", ms=ms, rate=f"{tflops:.0f} TFLOP/s"))
    return tflops


# --- 3-5. timed cases ---


def decode_case(b: Bench, ops, batch: int, context: int, copy_gbps: float, **tiles) -> Row:
    heads, kv_heads, head_dim = HEADS_7B
    dtype = torch.bfloat16
    p = make_paged([context] * batch, kv_heads, head_dim, dtype, b.device)
    q = torch.randn(batch, heads, head_dim, device=b.device, dtype=dtype)
    ctx = torch.full((batch,), context, device=b.device)
    scale = head_dim**-0.5

    def run():
        return ops.decode_attention(q, p.k_cache, p.v_cache, p.tables, ctx, context, scale, **tiles)

    out = run()
    block_size = p.k_cache.shape[1]
    n = -(-context // block_size)
    ids = p.tables[:, :n].flatten()
    shape = (batch, n * block_size, kv_heads, head_dim)
    k = p.k_cache.index_select(0, ids).view(shape)[:, :context].transpose(1, 2).contiguous()
    v = p.v_cache.index_select(0, ids).view(shape)[:, :context].transpose(1, 2).contiguous()
    qs = q[:, :, None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            qs, k, v, scale=scale, enable_gqa=True
        )

    want = sdpa()[:, :, 0]
    row = _check_row(rel_error(out, want), dtype, "vs SDPA")
    row.ms = b.median_ms(run)
    row.sdpa_ms = b.median_ms(sdpa)
    moved = 2 * batch * context * kv_heads * head_dim * 2 + 2 * q.numel() * 2
    gbps = moved / row.ms / 1e6
    row.rate, row.pct = f"{gbps:.0f} GB/s", 100 * gbps / copy_gbps
    row.data.update(gbps=round(gbps, 1), sdpa_gbps=round(moved / row.sdpa_ms / 1e6, 1))
    return row


def int8_decode_case(b: Bench, ops, ref, batch: int, context: int, copy_gbps: float) -> Row:
    """Decode attention over an int8 cache against the same over the bf16 cache it was
    quantized from (the 'SDPA' column), same queries: what half the bytes buys."""
    heads, kv_heads, head_dim = HEADS_7B
    dtype = torch.bfloat16
    p16 = make_paged([context] * batch, kv_heads, head_dim, dtype, b.device)
    p8 = int8_paged(p16)
    q = torch.randn(batch, heads, head_dim, device=b.device, dtype=dtype)
    ctx = torch.full((batch,), context, device=b.device)
    args = (p16.tables, ctx, context, head_dim**-0.5)
    out = ops.decode_attention(q, p8.k_cache, p8.v_cache, *args)
    want = ref.decode_attention(q.float(), p8.k_cache, p8.v_cache, *args)
    row = _check_row(rel_error(out, want), dtype, "vs the reference on the same int8 blocks")
    row.ms = b.median_ms(lambda: ops.decode_attention(q, p8.k_cache, p8.v_cache, *args))
    row.sdpa_ms = b.median_ms(lambda: ops.decode_attention(q, p16.k_cache, p16.v_cache, *args))
    row.note += "; 'SDPA' column: the triton kernel on the bf16 cache"
    moved = 2 * batch * context * kv_heads * (head_dim + 2) + 2 * q.numel() * 2
    gbps = moved / row.ms / 1e6
    row.rate, row.pct = f"{gbps:.0f} GB/s", 100 * gbps / copy_gbps
    row.data.update(gbps=round(gbps, 1), bf16_over_int8=round(row.sdpa_ms / row.ms, 2))
    return row


def prefill_case(b: Bench, ops, new: int, prefix: int, mm_tflops: float, **tiles) -> Row:
    heads, kv_heads, head_dim = HEADS_7B
    dtype = torch.bfloat16
    context = prefix + new
    p = make_paged([context], kv_heads, head_dim, dtype, b.device)
    q = torch.randn(new, heads, head_dim, device=b.device, dtype=dtype)
    scale = head_dim**-0.5

    def run():
        return ops.prefill_attention(q, p.k_cache, p.v_cache, p.tables[0], context, scale, **tiles)

    out = run()
    k, v = contiguous_kv(p, 0, context)
    k, v, qh = k[None].contiguous(), v[None].contiguous(), q.transpose(0, 1)[None].contiguous()
    mask = None
    if prefix:  # bottom-right causal: SDPA's is_causal aligns top-left when lengths differ
        rows = torch.arange(new, device=b.device)[:, None] + prefix
        mask = torch.arange(context, device=b.device)[None, :] <= rows

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    want = sdpa()[0].transpose(0, 1)
    row = _check_row(rel_error(out, want), dtype, "vs SDPA" + (" (masked)" if prefix else ""))
    row.ms = b.median_ms(run)
    row.sdpa_ms = b.median_ms(sdpa)
    flops = 4 * heads * head_dim * (new * prefix + new * (new + 1) / 2)  # QK^T and PV, causal
    tflops = flops / row.ms / 1e9
    row.rate, row.pct = f"{tflops:.0f} TFLOP/s", 100 * tflops / mm_tflops
    row.data.update(tflops=round(tflops, 1), sdpa_tflops=round(flops / row.sdpa_ms / 1e9, 1))
    return row


def store_case(b: Bench, ops, ref, tokens: int, copy_gbps: float) -> Row:
    _, kv_heads, head_dim = HEADS_7B
    dtype = torch.bfloat16
    p = make_paged([tokens], kv_heads, head_dim, dtype, b.device)
    block_size = p.k_cache.shape[1]
    slots = p.tables[0, :, None] * block_size + torch.arange(block_size, device=b.device)
    slots = slots.flatten()[:tokens]
    k = torch.randn(tokens, kv_heads, head_dim, device=b.device, dtype=dtype)
    v = torch.randn_like(k)
    want_k, want_v = p.k_cache.clone(), p.v_cache.clone()
    ref.store_kv(k, v, want_k, want_v, slots)
    ops.store_kv(k, v, p.k_cache, p.v_cache, slots)
    same = torch.equal(p.k_cache, want_k) and torch.equal(p.v_cache, want_v)
    row = Row("", "", ok=same, note="exact" if same else "differs from the reference")
    row.ms = b.median_ms(lambda: ops.store_kv(k, v, p.k_cache, p.v_cache, slots))
    gbps = 2 * 2 * k.numel() * 2 / row.ms / 1e6  # K and V, read and written
    row.rate, row.pct = f"{gbps:.0f} GB/s", 100 * gbps / copy_gbps
    row.sdpa_ms = b.median_ms(lambda: ref.store_kv(k, v, p.k_cache, p.v_cache, slots))
    row.note += "; 'SDPA' column: the torch reference (index_copy_)"
    return row


def kv_transfer_case(b: Bench, size_mib: int, copy_gbps: float) -> Row:
    """One request's KV, ``size_mib`` of it, from this process's cache to a spawned
    receiver's, both on ``b.device``, through the UCX backend (``tandem bench transfer
    --path backend --read get`` on the device). The ratio is to a device copy of the
    same bytes (the copy ceiling counts read + write)."""
    from tandem.bench.kv_pair import ReceiverProcess, fingerprint, kv_tensor, round_trips
    from tandem.bench.transfer import KVShape
    from tandem.kv_transfer import make_sender
    from tandem.kv_transfer.ucx.runtime import ucx_env_defaults

    ucx_env_defaults(tls=None, cuda=b.cuda)  # before UCX starts: its own choice (cuda_ipc)
    shape = KVShape(block_size=BLOCK_SIZE, **KV_SHAPE)
    blocks = shape.blocks_for(size_mib << 20)
    device = str(b.device)
    kv = kv_tensor(shape, blocks, torch.bfloat16, random=True, device=device)
    receiver = ReceiverProcess("get", shape, blocks, torch.bfloat16, device)
    sender = None
    try:
        sender = make_sender("ucx", kv, fingerprint(shape, torch.bfloat16, device))
        sender.connect(receiver("address"))
        times, arrived = round_trips(sender, receiver, blocks, "layer", 6, "kv")
    finally:
        if sender is not None:
            sender.close()
        receiver.stop()
    sent = kv[:, :, :blocks].cpu().contiguous().view(torch.uint8).numpy().tobytes()
    nbytes = blocks * shape.block_bytes
    ms = 1e3 * statistics.median(times[2:])
    gbps = nbytes / ms / 1e6
    same = arrived == sent
    return Row(
        "",
        "",
        ok=same,
        ms=ms,
        rate=f"{gbps:.1f} GB/s",
        pct=100 * gbps / (copy_gbps / 2),
        note=("bit-identical" if same else "blocks differ") + f", {nbytes / 2**20:.0f} MiB",
        data={"bytes": nbytes, "gbps": round(gbps, 2)},
    )


def tensor_parallel_case(b: Bench, ranks: int) -> Row:
    """An engine on ``ranks`` GPUs (NCCL) against one: the same greedy tokens, and the
    time of a short batch on each (tiny-random: the collectives' cost, not compute).
    (generate returns tokens, so each timing ends with the device's work.)"""
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (5, 40, 200)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    times, outputs = [], []
    for tp in (1, ranks):
        engine = LLMEngine(EngineConfig(model="tiny-random", device=str(b.device),
                                        dtype="float32", tensor_parallel_size=tp))  # fmt: skip
        try:
            engine.generate(prompts, params)  # warm-up
            started = time.perf_counter()
            outputs.append(engine.generate(prompts, params))
            times.append(1e3 * (time.perf_counter() - started))
        finally:
            engine.close()
    same = outputs[0] == outputs[1]
    return Row(
        "",
        "",
        ok=same,
        ms=times[1],
        note=f"{'same tokens' if same else 'tokens differ'}; one GPU {times[0]:.1f} ms, "
        f"{ranks} ranks {times[1]:.1f} ms for 3 x 64 tokens",
        data={"one_gpu_ms": round(times[0], 2), "ranks_ms": round(times[1], 2)},
    )


def checksum_case(b: Bench, size_mib: float, copy_gbps: float, kv_shape: dict | None = None) -> Row:
    """One request's KV (every layer, K and V, ``size_mib`` of it) checksummed where it
    lies on ``b.device``: the Triton kernel against the torch computation (equal), a
    flipped bit (caught), and the kernel's time against the host path it replaced.
    The ratio is to the copy ceiling's read half (the checksum reads each byte once)."""
    import xxhash

    from tandem.kv_transfer import device_checksum

    shape = kv_shape or KV_SHAPE
    # KVShape.block_bytes, without tandem.bench.transfer (and the grpc it imports).
    block_bytes = shape["layers"] * 2 * BLOCK_SIZE * shape["kv_heads"] * shape["head_dim"] * 2
    blocks = max(1, round(size_mib * 2**20 / block_bytes))
    dims = (shape["layers"], 2, blocks + 1, BLOCK_SIZE, shape["kv_heads"], shape["head_dim"])
    kv = torch.randn(dims, device=b.device).to(torch.bfloat16)
    ids, layers = list(range(blocks - 1, -1, -1)), (0, shape["layers"])  # reversed: one run each

    def device():
        return device_checksum.checksum_triton(kv, ids, layers)

    def host():  # what payload.checksum_blocks did for a GPU cache before
        digest = xxhash.xxh3_64()
        for layer in range(*layers):
            for k_or_v in (0, 1):
                for block in ids:
                    digest.update(kv[layer, k_or_v, block].cpu().view(torch.uint8).numpy())
        return digest.intdigest()

    value = device()
    same = value == device_checksum.checksum_torch(kv, ids, layers)
    kv.view(-1).view(torch.int16)[kv[0, 0, 0].numel() // 2] ^= 1  # one bit, in block 0
    caught = device() != value
    ms, host_ms = b.median_ms(device), b.median_ms(host)
    nbytes = blocks * block_bytes
    gbps = nbytes / ms / 1e6
    return Row(
        "",
        "",
        ok=same and caught,
        ms=ms,
        rate=f"{gbps:.1f} GB/s",
        pct=100 * gbps / (copy_gbps / 2) if math.isfinite(copy_gbps) else None,
        note=f"{'equal to torch' if same else 'DIFFERS from torch'}, "
        f"{'bit flip caught' if caught else 'bit flip MISSED'}; host path {host_ms:.2f} ms "
        f"({host_ms / ms:.1f}x), {nbytes / 2**20:g} MiB",
        data={"bytes": nbytes, "gbps": round(gbps, 2), "host_ms": round(host_ms, 3)},
    )


def host_tier_case(b: Bench, blocks: int) -> Row:
    """The host KV tier behind a cache on ``b.device`` (tandem/engine/host_tier.py):
    page-locked at its exact size, and ``blocks`` 7B-style blocks (2 MiB each) swapped
    out and back bit-identical; GB/s of each way, against the PCIe-bound ceiling
    nothing here measures (read the two rates against each other and the link)."""
    from tandem.engine.host_tier import HostTier

    shape = (KV_SHAPE["layers"], 2, blocks + 1, BLOCK_SIZE, KV_SHAPE["kv_heads"],
             KV_SHAPE["head_dim"])  # fmt: skip
    cache = torch.randn(shape, device=b.device).to(torch.bfloat16)
    tier = HostTier(cache, blocks)
    pinned = tier.tensor.is_pinned() if b.cuda else None  # a host cache's tier is not
    ids = list(range(blocks))
    want = cache[:, :, :blocks].clone()
    out_ms = b.median_ms(lambda: tier.copy_out(cache, ids, ids), max_runs=10)
    cache[:, :, :blocks].zero_()
    in_ms = b.median_ms(lambda: tier.copy_in(cache, ids, ids), max_runs=10)
    same = torch.equal(cache[:, :, :blocks], want)
    nbytes = want.numel() * want.element_size()
    out_gbps, in_gbps = nbytes / out_ms / 1e6, nbytes / in_ms / 1e6
    locked = {True: "page-locked", False: "NOT page-locked", None: "host cache"}[pinned]
    return Row(
        "",
        "",
        ok=same and pinned is not False,
        ms=out_ms,
        rate=f"{out_gbps:.1f} GB/s out",
        note=f"{'bit-identical' if same else 'blocks DIFFER'}, "
        f"{locked}; in {in_ms:.2f} ms ({in_gbps:.1f} GB/s), {nbytes / 2**20:.0f} MiB",
        data={"bytes": nbytes, "out_gbps": round(out_gbps, 2), "in_gbps": round(in_gbps, 2)},
    )


def norm_rope_case(b: Bench, tokens: int) -> Row:
    from tandem.engine.rope import apply_rope

    heads, kv_heads, head_dim = HEADS_7B
    hidden = heads * head_dim
    weight = torch.ones(hidden, device=b.device, dtype=torch.bfloat16)

    def norm(x):  # RMSNorm.forward off the CPU (tandem/engine/model.py)
        return weight * torch.nn.functional.rms_norm(x, weight.shape, None, 1e-5)

    x = torch.randn(tokens, hidden, device=b.device, dtype=torch.bfloat16)
    qk = torch.randn(tokens, heads + kv_heads, head_dim, device=b.device, dtype=torch.bfloat16)
    cos = torch.randn(tokens, head_dim, device=b.device, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    with torch.inference_mode():
        norm_ms = b.median_ms(lambda: norm(x))
        rope_ms = b.median_ms(lambda: apply_rope(qk, cos, sin))
    # Per layer the engine runs two RMSNorms and one RoPE.
    row = Row(
        "", "", ms=2 * norm_ms + rope_ms, note=f"2 x RMSNorm {norm_ms:.3f} + RoPE {rope_ms:.3f} ms"
    )
    row.data.update(rmsnorm_ms=round(norm_ms, 4), rope_ms=round(rope_ms, 4))
    return row


# --- 6. tile sweep ---

DECODE_TILES = [
    {"block_n": n, "num_warps": w, "num_stages": s}
    for n in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3)
]
PREFILL_TILES = [
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
]


def _tiles(t: dict) -> str:
    return " ".join(f"{k.replace('block_', '').replace('num_', '')}={v}" for k, v in t.items())


# --- report ---


def report(b: Bench, summary: dict) -> int:
    print("\n| section | case | check | ms | rate | % ceiling | SDPA ms | SDPA / triton | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in b.rows:
        status = {None: "", True: "ok", False: "**FAIL**"}[r.ok]
        ms = f"{r.ms:.3f}" if r.ms is not None else ""
        pct = f"{r.pct:.0f}%" if r.pct is not None else ""
        sdpa = f"{r.sdpa_ms:.3f}" if r.sdpa_ms is not None else ""
        ratio = f"{r.sdpa_ms / r.ms:.2f}" if r.sdpa_ms and r.ms else ""
        print(f"| {r.section} | {r.case} | {status} | {ms} | {r.rate} | {pct} | {sdpa} | {ratio} "
              f"| {r.note} |")  # fmt: skip
    failed = [f"{r.section}: {r.case}" for r in b.rows if r.ok is False]
    summary.update(
        checked=sum(r.ok is not None for r in b.rows),
        failed=failed,
        skipped=sum(r.note.startswith("skipped") for r in b.rows),
        wall_s=round(time.monotonic() - b.start, 1),
        rows=[
            {"section": r.section, "case": r.case, "ok": r.ok, "ms": r.ms, "pct": r.pct,
             "sdpa_ms": r.sdpa_ms, **r.data}
            for r in b.rows
        ],
    )  # fmt: skip
    print(json.dumps(_finite(summary)))
    return 1 if failed else 0


def _finite(value):
    """``value`` with NaN and infinities as null: the last line is strict JSON (jq)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no tile sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="skip cases that would start after this"
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the kernels' import: @triton.jit reads it when decorating.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from tandem.kernels import torch_ref
        from tandem.kernels import triton as ops
    except ImportError as exc:
        print(f"cannot import the triton backend: {exc}")
        return 2

    device = torch.device("cuda" if cuda else "cpu")
    b = Bench(device, args.budget_s)
    summary: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "quick": args.quick}
    if not cuda:
        print("no CUDA device: nothing to time; checking the kernels on tiny shapes under "
              "TRITON_INTERPRET=1 instead", flush=True)  # fmt: skip
        torch.manual_seed(0)
        check_cases(b, ops, torch_ref, tiny=True)
        tiny = {"layers": 2, "kv_heads": 2, "head_dim": 16}
        b.run(
            "checksum", "device checksum, tiny", partial(checksum_case, b, 1 / 16, math.nan, tiny)
        )
        return report(b, summary)

    # A call ended by its time limit (SIGTERM) still prints its table and JSON line.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        run_on_gpu(b, args, summary, ops, torch_ref)
    except BaseException as exc:  # noqa: BLE001 - what ran is still reported
        traceback.print_exc(file=sys.stdout)
        b.rows.append(Row("run", "stopped early", ok=False, note=f"{type(exc).__name__}: {exc}"))
    return report(b, summary)


def _terminated(signum, frame):
    raise SystemExit(f"signal {signum}: stopped before the end")


def run_on_gpu(b: Bench, args: argparse.Namespace, summary: dict, ops, torch_ref) -> None:
    torch.manual_seed(0)
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    summary.update(torch=torch.__version__, c_compiler=compiler)
    print(
        f"{summary['device']}, torch {torch.__version__}, budget {args.budget_s:.0f} s, "
        f"C compiler {compiler or 'NONE (Triton builds its launcher with one: expect failures)'}",
        flush=True,
    )
    try:
        copy_bw, mm_rate = copy_gbps(b), matmul_tflops(b)
    except Exception as exc:  # noqa: BLE001 - the checks and timings still say something
        traceback.print_exc(file=sys.stdout)
        b.rows.append(Row("ceiling", "copy and matmul", ok=False, note=f"ERROR {exc}"))
        copy_bw = mm_rate = math.nan
        b.check_device()
    print(f"ceilings: copy {copy_bw:.0f} GB/s, bf16 matmul {mm_rate:.0f} TFLOP/s", flush=True)
    summary.update(copy_gbps=round(copy_bw, 1), matmul_tflops=round(mm_rate, 1))

    check_cases(b, ops, torch_ref, tiny=False)

    batches = (1, 64, 256) if args.quick else (1, 8, 64, 256)
    contexts = (1024, 4096) if args.quick else (128, 1024, 4096, 32768)
    shapes = [(bt, c) for bt in batches for c in contexts if bt * c <= MAX_TOKENS]
    if args.quick:
        shapes.append((1, 32768))
    for batch, context in shapes:
        case = partial(decode_case, b, ops, batch, context, copy_bw)
        row = b.run("decode", f"batch {batch} x {context} ctx", case)
        if (batch, context) == (64, 4096) and row and row.pct is not None:
            summary["decode_64x4k"] = {"pct_of_copy": round(row.pct, 1),
                                       "target_met": row.pct >= 100 * TARGET_DECODE}  # fmt: skip
        b.free()

    prefills = [(2048, 0), (8192, 0), (4096, 4096)]
    if not args.quick:
        prefills = [(512, 0), (2048, 0), (8192, 0), (16384, 0), (4096, 4096), (512, 15872)]
    for new, prefix in prefills:
        name = f"{new} new" + (f" + {prefix} cached" if prefix else "")
        row = b.run("prefill", name, partial(prefill_case, b, ops, new, prefix, mm_rate))
        if (new, prefix) == (8192, 0) and row and row.pct is not None:
            summary["prefill_8k"] = {"pct_of_matmul": round(row.pct, 1),
                                     "target_met": row.pct >= 100 * TARGET_PREFILL}  # fmt: skip
        b.free()

    for tokens in (256, 8192):
        b.run("store", f"{tokens} tokens", partial(store_case, b, ops, torch_ref, tokens, copy_bw))

    for batch, context in ((1, 32768), (64, 4096)):
        case = partial(int8_decode_case, b, ops, torch_ref, batch, context, copy_bw)
        b.run("int8 kv", f"decode batch {batch} x {context} ctx", case)
        b.free()

    for tokens in (64, 8192):
        b.run("profile", f"norms + rope, {tokens} tokens", partial(norm_rope_case, b, tokens))

    missing = [m for m in KV_MODULES if importlib.util.find_spec(m) is None]
    for mib in (64,) if args.quick else (16, 256):
        name = f"ucx {mib} MiB, layer by layer"
        if missing:  # a bare GPU image: the kernels need torch and triton only
            b.rows.append(Row("kvxfer", name, note=f"skipped: no {', '.join(missing)}"))
            continue
        b.run("kvxfer", name, partial(kv_transfer_case, b, mib, copy_bw))
    for mib in (64,) if args.quick else (16, 256):
        name = f"{mib} MiB on the device"
        b.run("checksum", name, partial(checksum_case, b, mib, copy_bw))
    b.run("tier", "host tier, 256 blocks out and in", partial(host_tier_case, b, 256))
    gpus = torch.cuda.device_count()
    if gpus < 2:
        note = f"skipped: NCCL needs one rank per GPU, and this machine has {gpus}"
        b.rows.append(Row("tp", "tiny-random on 2 ranks", note=note))
    else:
        b.run("tp", "tiny-random on 2 ranks", partial(tensor_parallel_case, b, 2))

    # Last: where the budget runs short, it cuts the sweep, not the checks above.
    if not (args.quick or args.no_sweep):
        for tiles in DECODE_TILES:
            case = partial(decode_case, b, ops, 64, 4096, copy_bw, **tiles)
            b.run("sweep", f"decode 64x4k {_tiles(tiles)}", case)
        for tiles in PREFILL_TILES:
            case = partial(prefill_case, b, ops, 8192, 0, mm_rate, **tiles)
            b.run("sweep", f"prefill 8k {_tiles(tiles)}", case)
        b.free()


if __name__ == "__main__":
    sys.exit(main())
