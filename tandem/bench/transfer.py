"""KV transfer bandwidth: UCX between two processes vs a plain memcpy, in one run.

The benchmark is the sender (a prefill worker's role); it spawns a receiver
process (the decode worker's role) and connects to it once over 127.0.0.1, on a
port the receiver's listener picks at run time; ``tandem/bench/ucx_pair.py`` has
the two ends and their protocol (payload messages, an ack per iteration, a CRC32
of what arrived at the end of each size).

The payload is KV-shaped, ``[layers, 2, blocks, block_size, kv_heads, head_dim]``
for a SmolLM2-135M-like model, with ``blocks`` chosen so the payload is as close
as whole blocks allow to the requested size (``size_bytes`` reports the exact
bytes moved). It goes as one message per request or, with ``--split layer``, one
message per layer, all posted at once. The median of ``--iters`` round trips
(after ``--warmup``) gives UCX GB/s; the memcpy figure is ``numpy.copyto`` of the
same number of bytes between two preallocated buffers in this process.

``--path transport`` (the default) measures bare UCX messages of the request's
size: no handshake, checksum or block layout is timed. ``--path backend`` times
Tandem's KV transfer backend itself (``tandem/bench/kv_pair.py``), one request
per round trip until its ack: the sender checksums the blocks where they lie,
the receiver reads them out of the sender's cache into its own blocks and
verifies them there. Each read path (``--read``) runs in turn in the same run:
``mapped`` (the sender's cache mapped into the receiver, as between workers on
one host) and ``get`` (UCX one-sided reads, the path across hosts and GPUs).
bench/README.md has the figures and what moves them (transports, endpoint error
handling, rendezvous, message split, progress mode).

UCX reads ``UCX_*`` variables when its context is created, so ``--tls`` and
``--rndv-thresh`` are put into the environment before ucxx is imported here and
before the receiver is spawned (it inherits them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from tandem.bench.ucx_pair import PROGRESS_MODES, Sender, crc32
from tandem.errors import TandemError
from tandem.kv_transfer.ucx.runtime import ucx_env_defaults

UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "B": 1}
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class KVShape:
    """One request's KV for every layer; the defaults are SmolLM2-135M's."""

    layers: int = 30
    block_size: int = 16
    kv_heads: int = 3
    head_dim: int = 64
    dtype_bytes: int = 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    def blocks_for(self, size: int) -> int:
        return max(1, round(size / self.block_bytes))


@dataclass(frozen=True)
class Row:
    label: str
    backend: str
    size_bytes: int
    blocks: int
    messages: int
    gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.memcpy_gbps


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit, scale in UNITS.items():
        if t.endswith(unit) and t[: -len(unit)].isdigit():
            return int(t[: -len(unit)]) * scale
    if t.isdigit():
        return int(t)
    raise TandemError(f"--sizes: cannot read {text!r}; use e.g. 64KiB, 16MiB or 1048576")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB", help="comma-separated sizes")
    p.add_argument(
        "--read",
        default="mapped,get",
        help="with --path backend: how the receiver reads the sender's blocks, comma-"
        "separated and timed in turn: mapped (same host) and get (UCX one-sided reads)",
    )
    p.add_argument(
        "--path",
        default="transport",
        choices=["transport", "backend"],
        help="time bare UCX messages (default) or Tandem's KV transfer backend end to end "
        "(checksum, header, read into the blocks, verify, ack)",
    )
    p.add_argument(
        "--tls",
        default=None,
        help="UCX_TLS for both processes, e.g. tcp,self or posix,cma,tcp,self "
        "(default: the environment's, else UCX's own choice)",
    )
    p.add_argument(
        "--split",
        default="request",
        choices=["request", "layer"],
        help="one message per request (default) or one per layer",
    )
    p.add_argument(
        "--progress",
        default="blocking",
        choices=PROGRESS_MODES,
        help="how both sides drive UCX: wait on the worker's event fd (default), "
        "poll in the caller, or a ucxx progress thread",
    )
    p.add_argument(
        "--error-handling",
        action="store_true",
        help="UCX peer-failure detection on both endpoints, as the backend uses "
        "(--path backend always has it)",
    )
    p.add_argument(
        "--rndv-thresh", default=None, help="UCX_RNDV_THRESH for both processes (ucxx sets 8192)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--iters", type=int, default=50, help="timed round trips per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed round trips per size")
    p.add_argument("--json", action="store_true", help="print a JSON list on stdout")


def _set_ucx_env(args: argparse.Namespace) -> None:
    if args.tls:
        os.environ["UCX_TLS"] = args.tls
    if args.rndv_thresh:
        os.environ["UCX_RNDV_THRESH"] = args.rndv_thresh
    # UCX logs to stdout unless told otherwise; stdout is for the table or the JSON.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    # The backend's defaults, but UCX's own transport choice unless --tls says otherwise.
    ucx_env_defaults(tls=None)


def _memcpy_seconds(nbytes: int, iterations: int) -> float:
    import numpy as np

    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench_size(
    args: argparse.Namespace, sender: Sender, shape: KVShape, label: str, size: int
) -> Row:
    import numpy as np

    blocks = shape.blocks_for(size)
    # [layers, 2, blocks, block_size, kv_heads, head_dim]; random bytes, since UCX moves
    # bytes and numpy has no bfloat16.
    kv = np.random.default_rng(0).integers(0, 256, blocks * shape.block_bytes, dtype=np.uint8)
    kv = kv.reshape(shape.layers, -1)
    buffers = list(kv) if args.split == "layer" else [kv.reshape(-1)]
    sender.ctrl(buffers[0].nbytes, len(buffers), args.warmup + args.iters)
    times = sender.measure(buffers, args.warmup + args.iters)[args.warmup :]
    if sender.checksum() != crc32(buffers):
        raise TandemError(f"transfer benchmark: {label} arrived corrupted (CRC32 mismatch)")
    ucx_s = statistics.median(times)
    memcpy_s = _memcpy_seconds(kv.nbytes, args.iters)
    return Row(
        label,
        "ucx",
        kv.nbytes,
        blocks,
        len(buffers),
        kv.nbytes / ucx_s / 1e9,
        kv.nbytes / memcpy_s / 1e9,
    )


def _bench_backend(args: argparse.Namespace, shape: KVShape, labels, sizes) -> list[Row]:
    rows = []
    for read in args.reads:
        rows += _bench_one_read(args, read, shape, labels, sizes)
    return rows


def _bench_one_read(
    args: argparse.Namespace, read: str, shape: KVShape, labels, sizes
) -> list[Row]:
    import torch

    from tandem.bench.kv_pair import ReceiverProcess, fingerprint, kv_tensor, round_trips
    from tandem.kv_transfer import make_sender

    dtype = getattr(torch, args.dtype)
    most = max(shape.blocks_for(size) for size in sizes)
    kv = kv_tensor(shape, most, dtype, random=True)
    receiver = ReceiverProcess(read, shape, most, dtype)
    sender = None
    rows = []
    label = f"ucx-{read}"
    try:
        sender = make_sender("ucx", kv, fingerprint(shape, dtype))
        sender.connect(receiver("address"))
        for size_label, size in zip(labels, sizes, strict=True):
            print(f"{label} {size_label} ...", file=sys.stderr)
            blocks = shape.blocks_for(size)
            times, arrived = round_trips(
                sender, receiver, blocks, args.split, args.warmup + args.iters, size_label
            )
            sent = kv[:, :, :blocks].contiguous().view(torch.uint8).numpy().tobytes()
            if arrived != sent:
                raise TandemError(f"transfer benchmark: {label} {size_label} arrived changed")
            nbytes = blocks * shape.block_bytes
            seconds = statistics.median(times[args.warmup :])
            memcpy_s = _memcpy_seconds(nbytes, args.iters)
            messages = shape.layers if args.split == "layer" else 1
            rows.append(
                Row(
                    size_label,
                    label,
                    nbytes,
                    blocks,
                    messages,
                    nbytes / seconds / 1e9,
                    nbytes / memcpy_s / 1e9,
                )
            )
    finally:
        if sender is not None:
            sender.close()
        receiver.stop()
    return rows


def _reads(args: argparse.Namespace) -> list[str]:
    reads = [r.strip() for r in args.read.split(",") if r.strip()]
    bad = [r for r in reads if r not in ("mapped", "get")]
    if not reads or bad:
        raise TandemError(f"--read: choose from mapped and get, got {args.read!r}")
    return reads


def _bench_transport(args: argparse.Namespace, shape: KVShape, labels, sizes) -> list[Row]:
    sender = Sender(args.progress, args.error_handling)
    try:
        sender.start()
        rows = []
        for label, size in zip(labels, sizes, strict=True):
            print(f"{label} ...", file=sys.stderr)
            rows.append(_bench_size(args, sender, shape, label, size))
        sender.shutdown()
    finally:
        sender.kill()
    return rows


def run(args: argparse.Namespace) -> int:
    labels = [s.strip() for s in args.sizes.split(",") if s.strip()]
    sizes = [parse_size(s) for s in labels]
    if not sizes or min(sizes) < 1:
        raise TandemError(f"--sizes must list sizes >= 1 byte, got {args.sizes!r}")
    if args.iters < 1 or args.warmup < 0:
        raise TandemError(
            f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}"
        )
    args.reads = _reads(args)
    _set_ucx_env(args)
    shape = KVShape(dtype_bytes=DTYPE_BYTES[args.dtype])
    log = sys.stderr
    if args.path == "backend" and (args.progress != "blocking" or args.error_handling):
        raise TandemError(
            "--progress and --error-handling choose how bare UCX is driven (--path transport); "
            "the backend always runs a progress thread with error handling"
        )
    progress, error_handling = (
        ("thread", True) if args.path == "backend" else (args.progress, args.error_handling)
    )
    print(
        f"path={args.path} read={','.join(args.reads) if args.path == 'backend' else '-'} "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')} "
        f"split={args.split} progress={progress} error_handling={error_handling} "
        f"block={shape.block_bytes} B ({args.dtype}) iters={args.iters}",
        file=log,
    )
    bench = _bench_backend if args.path == "backend" else _bench_transport
    rows = bench(args, shape, labels, sizes)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "backend": r.backend,
                        "size_bytes": r.size_bytes,
                        "gbps": r.gbps,
                        "memcpy_gbps": r.memcpy_gbps,
                        "ratio": r.ratio,
                        "blocks": r.blocks,
                        "messages": r.messages,
                    }
                    for r in rows
                ]
            )
        )
    else:
        print(
            f"{'backend':>10} {'size':>8} {'bytes':>10} {'msgs':>5} {'GB/s':>6} "
            f"{'memcpy GB/s':>12} ratio"
        )
        for r in rows:
            print(
                f"{r.backend:>10} {r.label:>8} {r.size_bytes:>10} {r.messages:>5} {r.gbps:>6.2f} "
                f"{r.memcpy_gbps:>12.2f} {r.ratio:>6.2f}"
            )
    return 0
